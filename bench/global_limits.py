"""Service-wide limits against many clients, on loopback addresses 127.0.0.3-6 of one machine.

Run::

    .venv/bin/python bench/global_limits.py --out bench/results/global_limits.json

1. Bodies: a ``dcp serve`` without a token and default limits (32 MiB per body, 128 MiB of
   bodies in flight service-wide, 8 bodies per address). 32 clients, 8 on each of 4 addresses,
   send a 31 MB body each at once (a plan request padded with one long string); each client
   retries a 503 or 429 after its ``Retry-After``, at most ``--body-tries`` times. Reported: the
   server's peak RSS (``VmHWM``) before and after, its RSS after, and the answers by status.
2. Connections: a ``dcp serve`` with a token and default limits (2,048 connections, 1,024 per
   address). One address opens ``--idle`` connections that send nothing; meanwhile ranks fetch
   their views with the token, from another address and from the attacker's own. Reported: how
   many fetches were answered 200, and how many of the idle connections the server left open.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script import loadavg, log_to_console, parser_with_out  # bench/ (the script's folder) is on sys.path
from faults import COST_MODEL, Server, _body
from provenance import provenance

logger = logging.getLogger("bench.global_limits")

MB = 1_000_000
TOKEN = "bench-token"


def rss_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def send_body(port: int, source: str, body: bytes, tries: int) -> list[int]:
    """POST ``body`` from ``source``; the statuses of each try (0: the connection broke)."""
    statuses = []
    head = (f"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(tries):
        status, retry_after = 0, 1.0
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0)) as sock:
                sock.sendall(head)
                with contextlib.suppress(OSError):  # refused early: the answer is already there
                    sock.sendall(body)
                answer = sock.recv(65536)
            status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1") else 0
            for line in answer.split(b"\r\n"):
                if line.lower().startswith(b"retry-after:"):
                    retry_after = float(line.split(b":")[1])
        except OSError:
            status = 0
        statuses.append(status)
        if status not in (0, 429, 503):
            break
        time.sleep(retry_after)
    return statuses


def bodies_case(base: Path, *, tries: int) -> dict[str, Any]:
    (base / "bodies").mkdir()
    server = Server(base / "bodies", workers=1).start()
    assert server.proc is not None
    pid = server.proc.pid
    idle_peak = rss_bytes(pid, "VmHWM")
    pad = "x" * (31 * MB - 200)
    body = json.dumps({"samples": [{"id": "a", "tokens": 1024}], "cluster": "h200x8",
                       "cost_model_id": COST_MODEL, "pad": pad}).encode()
    results: list[list[int]] = []
    lock = threading.Lock()

    def client(source: str) -> None:
        got = send_body(server.port, source, body, tries)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=client, args=(f"127.0.0.{3 + i % 4}",)) for i in range(32)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    elapsed_s = time.monotonic() - started
    peak = rss_bytes(pid, "VmHWM")
    after = rss_bytes(pid, "VmRSS")
    server.stop()
    finals = collections.Counter(r[-1] for r in results)
    every = collections.Counter(s for r in results for s in r)
    return {"clients": 32, "addresses": 4, "body_bytes": len(body), "max_body_bytes_in_flight": 128 * 1024 * 1024,
            "peak_rss_before_mb": round(idle_peak / 2**20, 1), "peak_rss_mb": round(peak / 2**20, 1),
            "rss_after_mb": round(after / 2**20, 1), "final_status": dict(finals), "every_answer": dict(every),
            "tries_per_client_max": tries, "elapsed_s": round(elapsed_s, 1)}


def connections_case(base: Path, *, idle: int) -> dict[str, Any]:
    (base / "conns").mkdir()
    server = Server(base / "conns", workers=1, env={"DCP_AUTH_TOKEN": TOKEN}).start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    httpx.post(f"{server.url}/v1/epochs", json=_body("e"), headers=auth, timeout=60)
    while httpx.get(f"{server.url}/v1/epochs/e", headers=auth, timeout=30).json()["state"] != "done":
        time.sleep(0.2)
    socks = []
    refused_at_connect = 0
    for _ in range(idle):
        try:
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=10,
                                                  source_address=("127.0.0.3", 0)))
        except OSError:
            refused_at_connect += 1
    time.sleep(1.0)
    codes: collections.Counter[str] = collections.Counter()
    for source in ("127.0.0.4", "127.0.0.3"):
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
            for step in range(40):
                try:
                    fetched = client.get(f"{server.url}/v1/epochs/e/steps/{step}/ranks/0", headers=auth)
                    codes[f"{source} {fetched.status_code}"] += 1
                except httpx.HTTPError as exc:
                    codes[f"{source} {type(exc).__name__}"] += 1
    still_open = 0
    for sock in socks:
        sock.settimeout(0.01)
        try:
            if sock.recv(1) != b"":
                still_open += 1
        except TimeoutError:
            still_open += 1
        except OSError:
            pass
        sock.close()
    server.stop()
    return {"idle_connections": idle, "refused_at_connect": refused_at_connect,
            "idle_left_open_by_server": still_open, "max_connections": 2048,
            "max_connections_per_client": 1024, "rank_fetches": dict(codes)}


def main() -> int:
    """Run both cases, print them, write the JSON."""
    parser = parser_with_out(__doc__, "global_limits")
    parser.add_argument("--idle", type=int, default=2500)
    parser.add_argument("--body-tries", type=int, default=30)
    args = parser.parse_args()
    log_to_console()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 1024)), hard))
    load_before = loadavg()
    base = Path(tempfile.mkdtemp(prefix="dcp-limits-"))
    bodies = bodies_case(base, tries=args.body_tries)
    print(json.dumps(bodies, indent=1))
    conns = connections_case(base, idle=args.idle)
    print(json.dumps(conns, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "bodies": bodies, "connections": conns,
                                    "loadavg_before": load_before, "loadavg_after": loadavg()},
                                   indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
