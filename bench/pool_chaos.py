"""Chaos on the solver pool of a real ``dcp serve``: many SIGKILLs of both workers at once, at
random moments, while epoch jobs run, plus SIGKILLs of the server itself.

Run::

    .venv/bin/python bench/pool_chaos.py --kills 50 --out bench/results/pool_chaos.json

A reference epoch (``bench/faults.py``'s job: 80 steps of 12 samples on h200x8) is planned
first on a quiet server. Then the same job runs again and again under chaos: after a random
pause (0-1.5 s) both solver workers get SIGKILL at once (the out-of-memory killer's way), ``--kills``
times; the script measures how long ``/readyz`` takes to turn 503 (the pool noticed) and then 200
(both workers replaced and ready), and checks that the killed workers were reaped. After every
``--server-kill-every`` of those, the whole server gets SIGKILL as well and is restarted on the
same store. Each job must end ``done`` with the reference's digests (no plan lost, none duplicated or
different); a job that makes no progress for ``HANG_S`` counts as a hang. Prints a table, writes
the JSON.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script import loadavg, log_to_console, parser_with_out  # bench/ (the script's folder) is on sys.path
from faults import FAULT_STEPS, Server, _body, reference_digests
from provenance import provenance

logger = logging.getLogger("bench.pool_chaos")

ROOT = Path(__file__).resolve().parent.parent
HANG_S = 120.0
"""A job with no new step for this long, or a readiness that does not come back, is a hang."""


def workers_of(pid: int) -> list[int]:
    """The server's spawned solver workers."""
    out = []
    for child in psutil.Process(pid).children():
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            out.append(child.pid)
    return out


def reaped(pid: int) -> bool:
    """The killed worker is gone, not left a zombie (pids are not reused this fast)."""
    try:
        psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    return False


def readiness_after_kill(server: Server, killed_at: float) -> tuple[float | None, float | None]:
    """Seconds from the kill to ``/readyz`` 503, and to 200 again (None: not within ``HANG_S``)."""
    down_s = up_s = None
    while time.monotonic() - killed_at < HANG_S:
        try:
            code = httpx.get(f"{server.url}/readyz", timeout=10).status_code
        except httpx.HTTPError:
            code = 0
        now = time.monotonic() - killed_at
        if code == 503 and down_s is None:
            down_s = now
        if code == 200 and down_s is not None:
            up_s = now
            break
        time.sleep(0.01)
    return down_s, up_s


def run(base: Path, *, kills: int, server_kill_every: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    reference = reference_digests(base, epoch_id="ref")

    (base / "chaos").mkdir()
    server = Server(base / "chaos").start()
    downs: list[float] = []
    ups: list[float] = []
    hangs: list[str] = []
    unreaped = 0
    server_kills = 0
    jobs: list[str] = []
    identical = 0
    job = None
    progress_at, last_done = time.monotonic(), -1
    events = kills + (kills // server_kill_every if server_kill_every else 0)
    for kill in range(1, events + 1):
        if job is None:
            job = f"c{len(jobs)}"
            jobs.append(job)
            server.post("/v1/epochs", _body(job))
            progress_at, last_done = time.monotonic(), -1
        time.sleep(rng.uniform(0.0, 1.5))
        assert server.proc is not None
        if server_kill_every and kill % (server_kill_every + 1) == 0:  # besides the worker kills
            server.stop(signal.SIGKILL)
            server_kills += 1
            server = Server(base / "chaos")
            server.start()
            logger.info("kill %d: server killed and restarted", kill)
        else:
            assert server.proc is not None
            victims = workers_of(server.proc.pid)
            killed_at = time.monotonic()
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            down_s, up_s = readiness_after_kill(server, killed_at)
            if down_s is None or up_s is None:
                hangs.append(f"kill {kill}: /readyz 503 after {down_s} s, 200 after {up_s} s")
            else:
                downs.append(down_s)
                ups.append(up_s)
            unreaped += sum(not reaped(pid) for pid in victims)
            logger.info("kill %d: %d worker(s); /readyz 503 after %s s, 200 after %s s", kill, len(victims),
                        down_s and round(down_s, 3), up_s and round(up_s, 3))
        status = server.status(job)
        if status["steps_done"] > last_done:
            progress_at, last_done = time.monotonic(), status["steps_done"]
        elif time.monotonic() - progress_at > HANG_S:
            hangs.append(f"job {job}: no step for {HANG_S:.0f} s ({status})")
        if status["state"] == "done":
            identical += server.digests(job) == reference
            job = None
        elif status["state"] not in ("queued", "running"):
            hangs.append(f"job {job} ended {status['state']}: {status.get('error')}")
            job = None
    for epoch_id in jobs:
        try:
            server.wait(epoch_id, timeout_s=600)
        except RuntimeError:
            hangs.append(f"job {epoch_id} did not finish after the chaos")
            continue
    identical = sum(server.digests(epoch_id) == reference for epoch_id in jobs)
    # Last, a SIGTERM while both workers are stopped (alive, never answering) mid-epoch.
    server.post("/v1/epochs", _body("last"))
    server.wait("last", until=1)
    assert server.proc is not None
    for pid in workers_of(server.proc.pid):
        os.kill(pid, signal.SIGSTOP)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=120)
        sigterm_exit_s: float | None = round(time.monotonic() - signalled, 2)
    except subprocess.TimeoutExpired:
        sigterm_exit_s = None
        hangs.append("SIGTERM with stopped workers: still running after 120 s")
    server.stop(signal.SIGKILL)

    def summary(values: list[float]) -> dict[str, float | None]:
        return {"p50": round(statistics.median(values), 3) if values else None,
                "max": round(max(values), 3) if values else None}

    missed = len([h for h in hangs if h.startswith("kill")])
    return {"kills": kills, "events": events, "double_worker_kills": len(downs) + missed,
            "server_kills": server_kills, "hangs": hangs, "unreaped_workers": unreaped,
            "readyz_503_after_kill_s": summary(downs), "readyz_200_after_kill_s": summary(ups),
            "jobs": len(jobs), "jobs_identical_to_reference": identical, "steps_per_job": FAULT_STEPS,
            "sigterm_exit_with_stopped_workers_s": sigterm_exit_s}


def main() -> int:
    """Run the chaos, print the table, write the JSON."""
    parser = parser_with_out(__doc__, "pool_chaos")
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs of both workers at once.")
    parser.add_argument("--server-kill-every", type=int, default=17,
                        help="After every N worker kills, a SIGKILL of the server besides (0: never).")
    parser.add_argument("--seed", type=int, default=34)
    args = parser.parse_args()
    log_to_console()
    load_before = loadavg()
    result = run(Path(tempfile.mkdtemp(prefix="dcp-chaos-")), kills=args.kills,
                 server_kill_every=args.server_kill_every, seed=args.seed)
    result = {**provenance(), **result, "loadavg_before": load_before, "loadavg_after": loadavg(),
              "cpus": os.cpu_count()}
    for key in ("kills", "double_worker_kills", "server_kills", "unreaped_workers", "jobs",
                "jobs_identical_to_reference", "readyz_503_after_kill_s", "readyz_200_after_kill_s",
                "sigterm_exit_with_stopped_workers_s"):
        print(f"{key:<30} {result[key]}")
    print(f"{'hangs':<30} {len(result['hangs'])} {result['hangs'][:3]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not result["hangs"] and result["jobs_identical_to_reference"] == result["jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
