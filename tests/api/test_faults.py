"""Faults through a real ``dcp serve`` on loopback (issue 11): a plan stopped at its deadline, a
loop that answers /healthz while the store is locked or a large body is parsed, limits enforced
before the body is read, killed workers and locked stores that a job survives with identical
plans, failed and cancelled jobs that resume, orphans reaped, one server per store."""

from __future__ import annotations

import random
import socket
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import AUTH, COST_MODEL, FAST, alive, manifest_lines
from .test_server import _digests, _epoch, _wait

pytestmark = pytest.mark.timeout(240)

LOCK_HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
if sys.argv[2] == "released":
    sys.stdin.readline()
else:
    time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""


def hold_lock(db: Path, seconds: float | None) -> subprocess.Popen[str]:
    """Another process holding the store's write lock for ``seconds``, or (None) until a line is
    written to its stdin (``release_lock``)."""
    until = "released" if seconds is None else str(seconds)
    proc = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), until],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def release_lock(holder: subprocess.Popen[str]) -> None:
    """Let a holder started with ``hold_lock(db, None)`` commit, and wait for it."""
    assert holder.stdin is not None
    holder.stdin.write("release\n")
    holder.stdin.flush()
    holder.wait(timeout=60)


def healthz_latencies_s(url: str, *, count: int, pause_s: float = 0.01) -> list[float]:
    out = []
    with httpx.Client(timeout=10.0) as client:
        for _ in range(count):
            start = time.perf_counter()
            assert client.get(f"{url}/healthz").status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(pause_s)
    return out


FROZEN_BOUND_S = 0.3
"""How much later than idle /healthz may answer at p99 while the loop is loaded."""


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def raw_http(port: int, head: bytes, body: bytes = b"", *, wait_s: float = 10.0) -> bytes:
    """Send raw bytes and read the answer until the server closes or ``wait_s`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(head + body)
        chunks = []
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
        except TimeoutError:
            pass
    return b"".join(chunks)


def test_plan_stops_at_its_deadline_whatever_the_options(server_factory: Any) -> None:
    server = server_factory().start()
    rng = random.Random(0)
    samples = [{"id": f"s{i}", "tokens": rng.choice([512, 4096, 16384, 65536, 131072]) + i % 97}
               for i in range(4096)]
    heavy = {"time_limit_s": 1.0, "num_lpt_runs": 1000, "local_search_max_moves": 20000,
             "max_resize_tries": 256, "num_refined": 64, "num_target_probes": 64, "deep_search_min_gap": 0,
             "local_search_max_ejections": 1000}
    start = time.monotonic()
    response = server.request("POST", "/v1/plans", json={"samples": samples, "cluster": "h200x64",
                                                          "cost_model_id": COST_MODEL, "options": heavy})
    elapsed_s = time.monotonic() - start
    assert response.status_code == 422, response.text[:300]
    assert response.json()["detail"][0]["loc"] == ["body", "options", "time_limit_s"]
    # the 422 naming time_limit_s shows the deadline ended it (the plan itself runs minutes with
    # these options); the bound only catches a deadline that fires far too late: 3.5 s on a quiet
    # box, 6.1 s beside a second test suite on 2 cores
    assert elapsed_s < 1.0 + 30.0, elapsed_s
    small = {"samples": samples[:8], "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    assert server.request("POST", "/v1/plans", json=small).status_code == 200  # the worker is fine


def test_loop_answers_while_the_store_is_locked(server_factory: Any) -> None:
    server = server_factory(env={"DCP_STORE_BUSY_TIMEOUT_S": "1.5"}).start()
    db = server.tmp_path / "plans.sqlite"
    assert server.request("GET", "/v1/epochs").status_code == 200
    idle = healthz_latencies_s(server.url, count=50)
    holder = hold_lock(db, 4.0)
    codes: list[int] = []
    details: list[str] = []

    def write(i: int) -> None:
        body = {"manifest_jsonl": manifest_lines(4, prefix=f"w{i}-"), "batch": {"samples_per_step": 2},
                "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
        response = server.request("POST", "/v1/epochs", json=body)
        codes.append(response.status_code)
        details.append(response.text)

    writers = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in writers:
        t.start()
    latencies = healthz_latencies_s(server.url, count=100)
    reads = [server.request("GET", "/v1/cost-models").status_code for _ in range(5)]
    for t in writers:
        t.join()
    holder.wait(timeout=30)
    # A frozen loop answered in 3-28 s (issue 11); the bound is a tenth of the smallest freeze on
    # top of what the shared machine costs when idle (a loaded 2-core box adds ~100 ms at p99;
    # bench/faults.py measures the latencies).
    assert p99(latencies) < FROZEN_BOUND_S + p99(idle), f"healthz p99 {p99(latencies) * 1e3:.1f} ms while locked " \
                                               f"({p99(idle) * 1e3:.1f} ms idle)"
    assert reads == [200] * 5
    assert set(codes) <= {202, 503} and 503 in codes, codes
    assert all("locked" in d for c, d in zip(codes, details, strict=True) if c == 503)
    # After the lock: writes work, nothing half-written.
    assert server.request("POST", "/v1/epochs", json=_epoch("after", manifest_lines(4), 2)).status_code == 202
    assert _wait(server, "after")["state"] == "done"


def test_large_body_and_unauthenticated_body(server_factory: Any) -> None:
    server = server_factory(env={"DCP_MAX_BODY_BYTES": str(40_000_000)}).start()
    samples = ",".join(f'{{"id":"sample-{i}","tokens":{1000 + i % 5000}}}' for i in range(900_000))
    body = ('{"samples":[' + samples + '],"cluster":"h200x8","cost_model_id":"' + COST_MODEL + '"}').encode()
    assert len(body) > 30_000_000
    # Two tries at most: on the shared 2-core machine another process can take both cores for
    # a while; the loop itself must stay responsive in at least one of them.
    measured = []
    for _ in range(2):
        result: dict[str, Any] = {}
        idle = healthz_latencies_s(server.url, count=50)

        def post(out: dict[str, Any] = result) -> None:
            response = httpx.post(f"{server.url}/v1/plans", content=body, timeout=120,
                                  headers={**AUTH, "content-type": "application/json"})
            out.update(code=response.status_code, text=response.text)

        poster = threading.Thread(target=post)
        poster.start()
        latencies = healthz_latencies_s(server.url, count=150)
        poster.join()
        assert result["code"] == 413 and "values" in result["text"], result  # stopped while parsing
        measured.append((p99(latencies), p99(idle)))
        if p99(latencies) < FROZEN_BOUND_S + p99(idle):
            break
    assert any(busy < FROZEN_BOUND_S + idle_s for busy, idle_s in measured), \
        [f"healthz p99 {busy * 1e3:.1f} ms during a 30 MB body ({idle_s * 1e3:.1f} ms idle)"
         for busy, idle_s in measured]

    # Without the token, a large declared body is refused before a byte of it is read.
    start = time.monotonic()
    answer = raw_http(server.port, b"POST /v1/plans HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                   b"content-length: 30000000\r\n\r\n", wait_s=5.0)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"connection: close" in answer.lower() and time.monotonic() - start < 2.0


def test_chunked_over_limit_is_413_and_slow_body_is_408(server_factory: Any) -> None:
    server = server_factory(env={"DCP_BODY_READ_TIMEOUT_S": "1"}).start()
    auth = f"authorization: {AUTH['Authorization']}\r\n".encode()
    head = b"POST /v1/plans HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + auth
    chunk = b"x" * 65536
    chunked = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(20)) + b"0\r\n\r\n"
    # (the service reads the rest of the body before answering: answered and closed with bytes
    # unread, a reset could reach the client first and lose the answer; 6 of 150 under load before)
    for _ in range(10):
        answer = raw_http(server.port, head + b"transfer-encoding: chunked\r\n\r\n", chunked)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    start = time.monotonic()
    answer = raw_http(server.port, head + b"content-length: 100\r\n\r\n", b'{"samples": [')
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 0.8 < time.monotonic() - start < 5.0


def test_killed_worker_and_locked_store_do_not_fail_a_job(server_factory: Any) -> None:
    steps = 30  # the kill lands after the first write, with over 20 steps (~0.4 s each) to plan
    manifest = manifest_lines(12 * steps, seed=3)
    server = server_factory(workers=2, env={"DCP_STORE_BUSY_TIMEOUT_S": "0.5"}).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("ref", manifest, 12)).status_code == 202
    assert _wait(server, "ref")["state"] == "done"
    reference = _digests(server, "ref", steps)

    assert server.request("POST", "/v1/epochs", json=_epoch("hit", manifest, 12)).status_code == 202
    _wait(server, "hit", until=3)
    workers = [pid for pid in server.children() if "resource_tracker" not in _cmdline(pid)]
    assert workers
    import os
    import signal
    os.kill(workers[0], signal.SIGKILL)  # a worker killed, e.g. by the OOM killer
    holder = hold_lock(server.tmp_path / "plans.sqlite", 2.0)  # and the store locked for a while
    states = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = server.request("GET", "/v1/epochs/hit").json()
        states.add(status["state"])
        if status["state"] == "done":
            break
        time.sleep(0.05)
    holder.wait(timeout=30)
    assert status["state"] == "done", status
    assert "failed" not in states, states
    assert _digests(server, "hit", steps) == reference  # nothing lost, nothing different


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_failed_and_cancelled_jobs_resume(server_factory: Any) -> None:
    steps = 40  # the cancel and the stop land after the first write, with over 30 steps to plan
    manifest = manifest_lines(8 * steps, seed=9)
    server = server_factory(workers=2).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("ref", manifest, 8)).status_code == 202
    assert _wait(server, "ref")["state"] == "done"
    reference = _digests(server, "ref", steps)

    # Cancelled after two steps: on a loaded machine the job can finish before the cancel arrives
    # (then it stays done); a fresh job of the same inputs is tried then, until one is cancelled.
    for attempt in range(3):
        cancelled = f"c{attempt}"
        assert server.request("POST", "/v1/epochs", json=_epoch(cancelled, manifest, 8)).status_code == 202
        _wait(server, cancelled, until=2)
        state = server.request("POST", f"/v1/epochs/{cancelled}/cancel").json()["state"]
        if state != "done":
            break
    assert state == "cancelled"
    assert server.request("POST", f"/v1/epochs/{cancelled}/resume",
                          headers={"Authorization": "Bearer no"}).status_code == 401
    resumed = server.request("POST", f"/v1/epochs/{cancelled}/resume")
    assert resumed.status_code == 200 and resumed.json()["state"] in ("queued", "running", "done")
    assert _wait(server, cancelled)["state"] == "done"
    assert _digests(server, cancelled, steps) == reference
    assert server.request("POST", "/v1/epochs/nope/resume").status_code == 404

    # A job left failed for a transient reason (as after a full disk) resumes at start-up.
    assert server.request("POST", "/v1/epochs", json=_epoch("t", manifest, 8)).status_code == 202
    _wait(server, "t", until=2)
    server.terminate()
    conn = sqlite3.connect(server.tmp_path / "plans.sqlite")
    conn.execute("UPDATE epochs SET state='failed', transient=1, error='the plan store''s disk is full' "
                 "WHERE id='t'")
    conn.commit()
    conn.close()
    again = server_factory(workers=2).start()
    final = _wait(again, "t")
    assert final["state"] == "done", final
    assert _digests(again, "t", steps) == reference


def test_workers_exit_with_a_killed_server_and_one_server_per_store(server_factory: Any) -> None:
    import os
    import signal
    server = server_factory(workers=2).start()
    children = server.children()
    assert len(children) >= 2
    second = subprocess.run(
        [sys.executable, "-m", "dcp_cli.main", "serve", "--port", "0", "--db",
         str(server.tmp_path / "plans.sqlite")], capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and "in use by another server" in second.stderr, second.stderr[-500:]

    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)  # the server only, not its process group
    server.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in children):
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], [_cmdline(p) for p in children if alive(p)]
    # The lease died with it: a new server starts on the same file.
    assert server_factory(workers=1).start().request("GET", "/readyz").status_code == 200


def test_solver_workers_run_at_the_configured_niceness(server_factory: Any) -> None:
    """``DCP_WORKER_NICE``: the pool's processes give the CPU to co-located training ranks first;
    the server itself (the event loop answering ranks) keeps its priority."""
    import os

    server = server_factory(workers=2, env={"DCP_WORKER_NICE": "7"}).start()
    assert server.request("POST", "/v1/plans", json={"samples": [{"id": "a", "tokens": 4096}],
                                                     "cluster": "h200x8", "cost_model_id": COST_MODEL,
                                                     "options": FAST}).status_code == 200
    assert server.proc is not None
    base = os.getpriority(os.PRIO_PROCESS, server.proc.pid)
    workers = [pid for pid in server.children() if "resource_tracker" not in _cmdline(pid)]
    assert len(workers) == 2, workers
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in workers] == [base + 7, base + 7]
    refused = server_factory(env={"DCP_WORKER_NICE": "20"})
    with pytest.raises(Exception, match="worker_nice"):
        refused.start()
