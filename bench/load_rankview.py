"""Rank-view fetch load on a precomputed epoch, driven by ``wrk`` (a compiled load generator).

Run::

    .venv/bin/python bench/load_rankview.py                 # 3 x 30 s at 256 connections (~3 min)
    .venv/bin/python bench/load_rankview.py --connections 256 128 64   # 3 x 30 s at each (~5 min)
    .venv/bin/python bench/load_rankview.py --duration-s 5 --runs 1 --out /tmp/l.json   # smoke

Starts ``dcp serve`` on loopback (a fresh SQLite file, 1 solver process, a token set as in a
deployment, so every fetch is authenticated), precomputes an epoch through ``POST /v1/epochs``
(the shipped ``examples/manifests/train.jsonl``, 2,048 samples in steps of 64 on ``h200x8``:
32 steps x 8 ranks = 256 rank views), fetches every view once (the first fetch of a step freezes
it), then runs ``wrk`` ``--runs`` times for each of ``--connections`` (keep-alive connections)
for ``--duration-s`` each, every request ``GET /v1/epochs/{id}/steps/{s}/ranks/{r}`` walking the
256 views round-robin (a Lua script). wrk's own latency percentiles (``--latency``: 50, 75, 90,
99 %), requests per second, socket errors and non-2xx answers are recorded per run, with the
server's resident set (main process, and with its solver process) before the first run and
after each, and the host load average. ``wrk`` runs on the same 2 cores as the server (it is C
and event-driven, so it takes far less CPU than a Python client would).

Writes ``--out`` (default ``bench-out/load_rankview.json``) and prints a table; exit code 1 when
``wrk`` is not installed (``apt-get install wrk``) or a run saw errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from _service import start_service, stop_service  # bench/ (the script's folder) is on sys.path
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

logger = logging.getLogger("bench.load_rankview")

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "load-token"
EPOCH_ID = "load-epoch"
CLUSTER = "h200x8"
NUM_RANKS = 8
SAMPLES_PER_STEP = 64

LUA = """-- round-robin over every (step, rank) view of the epoch
local i = 0
request = function()
  local step = math.floor(i / {ranks}) % {steps}
  local rank = i % {ranks}
  i = i + 1
  return wrk.format("GET", "/v1/epochs/{epoch}/steps/" .. step .. "/ranks/" .. rank)
end
"""


def _rss(pid: int) -> dict[str, int]:
    """Resident set of process ``pid`` alone and with its children (the solver workers)."""
    process = psutil.Process(pid)
    main = process.memory_info().rss
    return {"main_bytes": main, "with_children_bytes": main + sum(c.memory_info().rss for c in process.children())}


_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _seconds(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS_S[unit]


def parse_wrk(text: str) -> dict[str, Any]:
    """Latency percentiles (s), requests, requests/s, socket errors and non-2xx/3xx from ``wrk
    --latency`` output.

    Raises:
        ValueError: when the output has no latency distribution (wrk failed).
    """
    percentiles = {f"p{p}_s": _seconds(v) for p, v in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", text, re.M)}
    if len(percentiles) != 4:
        raise ValueError(f"no latency distribution in wrk's output:\n{text[-2000:]}")
    total = re.search(r"(\d+) requests in ([\d.]+\w+)", text)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return {**percentiles, "requests": int(total.group(1)) if total else 0,
            "requests_per_s": float(rate.group(1)) if rate else 0.0,
            "socket_errors": dict(zip(("connect", "read", "write", "timeout"),
                                      map(int, socket_errors.groups()), strict=True)) if socket_errors else {},
            "non_2xx_3xx": int(non_2xx.group(1)) if non_2xx else 0}


def _precompute(url: str, manifest: Path) -> int:
    """Plan the epoch through the API; its number of steps."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"epoch_id": EPOCH_ID, "manifest_jsonl": manifest.read_text(), "seed": 0, "cluster": CLUSTER,
            "model": "llama-7b", "batch": {"samples_per_step": SAMPLES_PER_STEP}, "options": {"time_limit_s": 0.2}}
    response = httpx.post(f"{url}/v1/epochs", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/epochs/{EPOCH_ID}", headers=headers, timeout=30).json()
        if status["state"] == "done":
            return int(status["steps_total"])
        if status["state"] in ("failed", "cancelled"):
            raise RuntimeError(f"epoch {status['state']}: {status.get('error')}")
        time.sleep(0.5)
    raise RuntimeError("epoch not done within 600 s")


def main() -> int:
    """Precompute, load with wrk, write the JSON and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, nargs="+", default=[256],
                        help="wrk connections; --runs runs for each value, in this order")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--duration-s", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=default_out("load_rankview"))
    parser.add_argument("--quiet", "-q", action="store_true", help="No log lines: the table only.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    wrk = shutil.which("wrk")
    if wrk is None:
        logger.error("wrk is not installed (apt-get install wrk); no Python client is substituted")
        return 1
    version = subprocess.run([wrk, "-v"], capture_output=True, text=True).stdout.splitlines()[0:1]
    tmp = Path(tempfile.mkdtemp(prefix="dcp-load-"))
    load_start = os.getloadavg()
    proc, url = start_service(tmp, log=tmp / "server.log", workers=1, env={"DCP_AUTH_TOKEN": TOKEN})
    try:
        num_steps = _precompute(url, ROOT / "examples" / "manifests" / "train.jsonl")
        lua = tmp / "rankview.lua"
        lua.write_text(LUA.format(ranks=NUM_RANKS, steps=num_steps, epoch=EPOCH_ID))
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            for step in range(num_steps):  # every view once: the first fetch freezes its step
                for rank in range(NUM_RANKS):
                    client.get(f"/v1/epochs/{EPOCH_ID}/steps/{step}/ranks/{rank}").raise_for_status()
        rss_before = _rss(proc.pid)
        runs = []
        for connections in args.connections:
            for index in range(args.runs):
                load = os.getloadavg()
                result = subprocess.run([wrk, "-t", str(args.threads), "-c", str(connections), "-d",
                                         f"{args.duration_s}s", "--latency", "--timeout", "10s", "-s", str(lua),
                                         "-H", f"Authorization: Bearer {TOKEN}", url],
                                        capture_output=True, text=True, timeout=args.duration_s + 120)
                run = {"run": index, "connections": connections, **parse_wrk(result.stdout),
                       "rss_after": _rss(proc.pid), "load_avg_1m_before": round(load[0], 2),
                       "wrk_output": result.stdout}
                logger.info("%d connections, run %d: p99 %.1f ms, %.0f req/s", connections, index,
                            run["p99_s"] * 1e3, run["requests_per_s"])
                runs.append(run)
    finally:
        stop_service(proc)
    summary = {"connections": args.connections, "wrk_threads": args.threads, "duration_s": args.duration_s,
               "epoch": {"manifest": "examples/manifests/train.jsonl", "cluster": CLUSTER,
                         "samples_per_step": SAMPLES_PER_STEP, "steps": num_steps, "ranks": NUM_RANKS,
                         "views": num_steps * NUM_RANKS},
               "auth": "bearer token on every fetch (DCP_AUTH_TOKEN set)", "wrk_version": version,
               "rss_before": rss_before, "runs": runs,
               "p99_s_max": max(r["p99_s"] for r in runs),
               "p99_s_max_by_connections": {str(c): max(r["p99_s"] for r in runs if r["connections"] == c)
                                            for c in args.connections},
               "server": "dcp serve: uvicorn 0.55 on the asyncio event loop with api/http_guard.py's "
                         "protocol (one socket write per response)",
               "errors": sum(sum(r["socket_errors"].values()) + r["non_2xx_3xx"] for r in runs),
               "rss_main_growth_bytes": runs[-1]["rss_after"]["main_bytes"] - rss_before["main_bytes"],
               "host_cpus": os.cpu_count(),
               "machine": {"loadavg_at_start": [round(x, 2) for x in load_start],
                           "loadavg_at_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()},
               "not_measured": "the server and wrk share the 2 cores (no second machine); no GPU; one "
                               "solver process idle during the load; no cache-defeating order (every "
                               "view is fetched round-robin)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), **summary}, indent=2) + "\n")
    print(f"{'conns':>5} {'run':>3} {'req/s':>8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'errors':>7} "
          f"{'RSS MiB':>8}")
    for r in runs:
        errors = sum(r["socket_errors"].values()) + r["non_2xx_3xx"]
        print(f"{r['connections']:>5} {r['run']:>3} {r['requests_per_s']:>8.0f} {r['p50_s'] * 1e3:>7.1f} "
              f"{r['p90_s'] * 1e3:>7.1f} {r['p99_s'] * 1e3:>7.1f} {errors:>7d} "
              f"{r['rss_after']['main_bytes'] / 2**20:>8.1f}")
    print(f"RSS before: {rss_before['main_bytes'] / 2**20:.1f} MiB (main process)")
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
