"""Planner-service benchmark against a real uvicorn on loopback (``dcp serve`` subprocess).

Run::

    .venv/bin/python bench/service_load.py            # full run (about 8 minutes on 2 cores)
    .venv/bin/python bench/service_load.py --quick    # smoke run (shorter phases)

Phases, each against the same service and SQLite file:

1. epoch precompute: a ``text-longtail`` manifest in 256-sample steps on ``h200x32`` with the
   embedded llama-7b cost model and the default solver budget, submitted to ``POST /v1/epochs``;
   steps per second from the job's own start/finish times, extrapolated to 10,000 steps, with
   the mean gap and predicted speedup over bucket;
2. synchronous ``POST /v1/plans`` latency (256-sample batches, default budget), p50/p99;
3. a 10,000-step epoch is written into the store (the real plans of phase 1, cycled with their
   step index rewritten: the store then holds 10,000 distinct plan rows), the service restarted;
4. stored-plan fetch load: N concurrent keep-alive clients, client ``i`` playing rank
   ``i % 32`` and walking the epoch's steps in order (what prefetching ranks do), each
   ``GET /v1/epochs/{id}/steps/{s}/ranks/{r}`` checked against the stored digest; 256 clients
   for 60 s and a lower concurrency, then a cache-defeating random-step run;
5. service RSS (main process, and with its solver workers) after the fetch runs.

The load generator is a raw asyncio HTTP/1.1 client in this process; on a 2-core machine it
shares the CPU with the service, so the latencies include that contention.
Writes ``--out`` (default ``bench-out/service_load.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api.store import PlanStore  # noqa: E402
from costmodel.specs import Sample  # noqa: E402
from dcp_cli.net import free_port  # noqa: E402
from dcp_cli.progress import make_progress  # noqa: E402
from planner.epoch import StepResult  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch, synthesize_manifest  # noqa: E402

CLUSTER = "h200x32"
NUM_RANKS = 32
COST_MODEL = "analytic-llama-7b-h200-sxm"
WORKLOAD = "text-longtail"
SAMPLES_PER_STEP = 256
FILL_STEPS = 10_000


class Service:
    """``dcp serve`` in its own session."""

    def __init__(self, db: Path, *, workers: int, log: Path) -> None:
        self.db, self.workers, self.log = db, workers, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Service:
        env = {**os.environ, "DCP_DB_PATH": str(self.db), "DCP_NUM_WORKERS": str(self.workers),
               "DCP_DATA_DIR": str(self.db.parent)}
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dcp_cli.main", "serve", "--port", str(self.port),
                 "--log-level", "warning"], env=env, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.db.parent)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"service not ready; see {self.log}")

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def rss_bytes(self) -> dict[str, int]:
        """RSS of the main process and of main + solver workers."""
        assert self.proc is not None
        process = psutil.Process(self.proc.pid)
        main = process.memory_info().rss
        children = process.children()
        return {"main": main, "with_workers": main + sum(c.memory_info().rss for c in children),
                "num_children": len(children)}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ------------------------------------------------------------------------ phase 1: epoch
def run_epoch_phase(svc: Service, *, num_steps: int, options: dict[str, Any]) -> dict[str, Any]:
    spec = WorkloadSpec.preset(WORKLOAD)
    manifest = synthesize_manifest(spec, num_samples=num_steps * SAMPLES_PER_STEP, seed=0)
    body = {"epoch_id": "bench-epoch", "batch": {"samples_per_step": SAMPLES_PER_STEP}, "seed": 0,
            "manifest_jsonl": "".join(s.model_dump_json(exclude_none=True) + "\n" for s in manifest),
            "cluster": CLUSTER, "cost_model_id": COST_MODEL, "options": options}
    response = httpx.post(f"{svc.url}/v1/epochs", json=body, timeout=120)
    response.raise_for_status()
    while True:
        status = httpx.get(f"{svc.url}/v1/epochs/bench-epoch", timeout=10).json()
        if status["state"] not in ("queued", "running"):
            break
        time.sleep(0.5)
    if status["state"] != "done":
        raise RuntimeError(f"epoch job ended {status['state']}: {status['error']}")
    elapsed_s = status["finished_at"] - status["started_at"]
    steps_per_s = status["steps_total"] / elapsed_s
    return {"workload": WORKLOAD, "cluster": CLUSTER, "cost_model": COST_MODEL,
            "samples_per_step": SAMPLES_PER_STEP, "steps": status["steps_total"],
            "wall_s": elapsed_s, "steps_per_s": steps_per_s,
            "extrapolated_10k_steps_s": 10_000 / steps_per_s,
            "mean_gap": status["summary"]["mean_gap"],
            "mean_speedup_vs_bucket": status["summary"]["mean_predicted_speedup_vs_bucket"],
            "options": options}


# ------------------------------------------------------------------------ phase 2: sync plans
def run_sync_phase(svc: Service, *, num_requests: int, options: dict[str, Any]) -> dict[str, Any]:
    spec = WorkloadSpec.preset(WORKLOAD)
    latencies, solve = [], []
    for i in range(num_requests):
        batch = sample_batch(spec, num_samples=SAMPLES_PER_STEP, seed=1, step=i)
        body = {"samples": [s.model_dump(exclude_none=True) for s in batch], "cluster": CLUSTER,
                "cost_model_id": COST_MODEL, "options": options}
        t0 = time.perf_counter()
        response = httpx.post(f"{svc.url}/v1/plans", json=body, timeout=120)
        latencies.append(time.perf_counter() - t0)
        response.raise_for_status()
        solve.append(response.json()["solve_time_s"])
    return {"requests": num_requests, "samples": SAMPLES_PER_STEP, "p50_s": _pct(latencies, 50),
            "p99_s": _pct(latencies, 99), "max_s": max(latencies),
            "solver_p50_s": _pct(solve, 50), "options": options}


# ------------------------------------------------------------------------ phase 3: 10k steps
def fill_store(db: Path, *, source_epoch: str, epoch_id: str, num_steps: int) -> dict[str, Any]:
    store = PlanStore.open(db)
    rows = store.get_plans(source_epoch, start=0, stop=10**9)
    plans = [Plan.model_validate_json(text) for _, _, text in rows]
    batches: list[list[Sample]] = []
    for step in range(num_steps):
        plan = plans[step % len(plans)]
        batches.append([ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples])
    record = store.get_epoch(source_epoch)
    assert record is not None
    store.create_epoch(epoch_id, spec={**record.spec, "note": f"{len(plans)} real plans cycled"},
                       steps=batches)
    batches.clear()
    chunk: list[StepResult] = []
    for step in range(num_steps):
        plan = plans[step % len(plans)].model_copy(update={"step": step})
        text = plan.canonical_json()
        chunk.append(StepResult(step=step, plan_json=text, digest=plan.digest(), gap=plan.gap,
                                predicted_step_time_s=plan.predicted_step_time_s,
                                speedup_vs_bucket=None, solve_time_s=0.0))
        if len(chunk) == 500:
            store.write_steps(epoch_id, chunk)
            chunk = []
    if chunk:
        store.write_steps(epoch_id, chunk)
    store.set_state(epoch_id, "done")
    store.close()
    return {"steps": num_steps, "distinct_plans": len(plans), "db_bytes": db.stat().st_size}


# ------------------------------------------------------------------------ phase 4: fetch load
async def _client(port: int, rank: int, steps: list[int], digests: dict[int, str], epoch_id: str,
                  stop_at: float, record_after: float, out: dict[str, Any],
                  interval_s: float | None, phase: float) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = 0
    next_at = time.perf_counter() + (interval_s or 0.0) * phase
    try:
        while True:
            now = time.perf_counter()
            if interval_s is not None:  # paced: one request every interval_s
                if next_at > now:
                    await asyncio.sleep(next_at - now)
                next_at += interval_s
            if time.perf_counter() >= stop_at:
                break
            step = steps[i % len(steps)]
            i += 1
            request = (f"GET /v1/epochs/{epoch_id}/steps/{step}/ranks/{rank} HTTP/1.1\r\n"
                       f"Host: 127.0.0.1\r\n\r\n").encode()
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            dt = time.perf_counter() - t0
            ok = head[9:12] == b"200" and f'"plan_digest":"{digests[step]}"'.encode() in body
            if t0 >= record_after:
                out["lat"].append(dt)
                if not ok:
                    out["errors"] += 1
    except (OSError, asyncio.IncompleteReadError) as exc:
        out["errors"] += 1
        out["exceptions"].append(repr(exc))
    finally:
        writer.close()


async def _load(port: int, *, epoch_id: str, num_clients: int, duration_s: float, warmup_s: float,
                digests: dict[int, str], order: str, interval_s: float | None) -> dict[str, Any]:
    all_steps = sorted(digests)
    out: dict[str, Any] = {"lat": [], "errors": 0, "exceptions": []}
    start = time.perf_counter()
    record_after, stop_at = start + warmup_s, start + warmup_s + duration_s
    tasks = []
    for i in range(num_clients):
        if order == "sequential":
            steps = all_steps
        else:
            steps = random.Random(i).sample(all_steps, len(all_steps))
        tasks.append(_client(port, i % NUM_RANKS, steps, digests, epoch_id, stop_at, record_after, out,
                             interval_s, i / num_clients))
    await asyncio.gather(*tasks)
    lat = out["lat"]
    return {"clients": num_clients, "order": order, "duration_s": duration_s,
            "mode": "closed-loop" if interval_s is None else f"paced {1 / interval_s:g} req/s per client",
            "requests": len(lat), "errors": out["errors"], "exceptions": out["exceptions"][:5],
            "throughput_rps": len(lat) / duration_s, "p50_ms": _pct(lat, 50) * 1e3,
            "p90_ms": _pct(lat, 90) * 1e3, "p99_ms": _pct(lat, 99) * 1e3,
            "max_ms": max(lat) * 1e3 if lat else float("nan"),
            "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan")}


RANK_ROUTE = "/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}"


def _server_buckets(svc: Service) -> dict[float, float]:
    """Cumulative counts of the service's own latency histogram for 200s of the rank route."""
    out: dict[float, float] = {}
    for line in httpx.get(f"{svc.url}/metrics", timeout=10).text.splitlines():
        if (line.startswith("dcp_http_request_duration_seconds_bucket{") and f'route="{RANK_ROUTE}"' in line
                and 'status="200"' in line):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def run_fetch(svc: Service, *, epoch_id: str, num_clients: int, duration_s: float, order: str,
              interval_s: float | None = None) -> dict[str, Any]:
    store = PlanStore.open(svc.db)
    digests = store.digests(epoch_id)
    store.close()
    before = _server_buckets(svc)
    result = asyncio.run(_load(svc.port, epoch_id=epoch_id, num_clients=num_clients,
                               duration_s=duration_s, warmup_s=2.0, digests=digests, order=order,
                               interval_s=interval_s))
    after = _server_buckets(svc)
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    # Server-side view (request received -> response sent, inside the service), from /metrics.
    result["server_share_within"] = {
        f"{le * 1e3:g}ms": (after[le] - before.get(le, 0.0)) / total
        for le in sorted(after) if le <= 0.01 and total > 0}
    return result


# ------------------------------------------------------------------------ main
def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Short phases (smoke run).")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="Solver processes.")
    parser.add_argument("--epoch-steps", type=int, default=None, help="Steps planned in phase 1.")
    parser.add_argument("--option", action="append", default=[], help="Planner option KEY=JSON.")
    parser.add_argument("--out", type=Path, default=default_out("service_load"))
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="No progress bar or per-phase figures: the table only.")
    args = parser.parse_args()

    def say(text: str) -> None:
        if not args.quiet:
            print(text, flush=True)

    options: dict[str, Any] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    epoch_steps = args.epoch_steps or (6 if args.quick else 200)
    fetch_s = 10.0 if args.quick else 60.0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip()
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                           "loadavg_1m_at_start": os.getloadavg()[0]},
                               "git_commit": commit, "quick": args.quick, "workers": args.workers}
    runs: list[tuple[int, str, float, float | None]] = [
        (256, "sequential", fetch_s, None), (256, "sequential", fetch_s, 1.0),
        (256, "sequential", fetch_s / 3, 0.25), (32, "sequential", fetch_s / 3, None),
        (1, "sequential", fetch_s / 6, None), (256, "random", fetch_s / 3, None)]
    bar = make_progress(quiet=args.quiet, transient=True)
    task = bar.add_task("service load phases", total=3 + len(runs))
    bar.start()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "plans.sqlite"
        log = Path(tmp) / "service.log"
        with Service(db, workers=args.workers, log=log) as svc:
            say(f"phase 1: epoch precompute, {epoch_steps} steps x {SAMPLES_PER_STEP} samples")
            load_before = os.getloadavg()[0]
            results["epoch"] = run_epoch_phase(svc, num_steps=epoch_steps, options=options)
            results["epoch"]["loadavg_1m_before_after"] = [load_before, os.getloadavg()[0]]
            say(json.dumps(results["epoch"], indent=1))
            bar.advance(task)
            say("phase 2: synchronous plans")
            results["sync_plan"] = run_sync_phase(svc, num_requests=5 if args.quick else 30,
                                                  options=options)
            say(json.dumps(results["sync_plan"], indent=1))
            bar.advance(task)
        say(f"phase 3: fill {FILL_STEPS} steps")
        results["fill"] = fill_store(db, source_epoch="bench-epoch", epoch_id="fill10k",
                                     num_steps=FILL_STEPS)
        bar.advance(task)
        with Service(db, workers=args.workers, log=log) as svc:
            results["rss_idle_bytes"] = svc.rss_bytes()
            results["fetch"] = []
            for clients, order, duration, interval in runs:
                say(f"phase 4: fetch, {clients} clients, {order}, {duration:.0f} s, interval {interval}")
                load_before = os.getloadavg()[0]
                run = run_fetch(svc, epoch_id="fill10k", num_clients=clients, duration_s=duration,
                                order=order, interval_s=interval)
                run["loadavg_1m_before_after"] = [load_before, os.getloadavg()[0]]
                run["rss_after_bytes"] = svc.rss_bytes()
                results["fetch"].append(run)
                say(json.dumps(run, indent=1))
                bar.advance(task)
    bar.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    print(f"wrote {args.out}")


def print_table(r: dict[str, Any]) -> None:
    e, s = r["epoch"], r["sync_plan"]
    print()
    print(f"epoch precompute ({e['steps']} x {e['samples_per_step']} samples, {e['cluster']}): "
          f"{e['steps_per_s']:.2f} steps/s -> 10,000 steps in {e['extrapolated_10k_steps_s'] / 60:.1f} min; "
          f"mean gap {e['mean_gap']:.3f}, mean speedup vs bucket {e['mean_speedup_vs_bucket']:.2f}x")
    print(f"sync plan ({s['samples']} samples): p50 {s['p50_s'] * 1e3:.0f} ms, p99 {s['p99_s'] * 1e3:.0f} ms")
    print(f"{'clients':>8} {'mode':>28} {'order':>10} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8} {'errors':>7} {'RSS MB':>7} {'server<=5ms':>11}")
    for f in r["fetch"]:
        print(f"{f['clients']:>8} {f['mode']:>28} {f['order']:>10} {f['throughput_rps']:>8.0f} {f['p50_ms']:>8.2f} "
              f"{f['p99_ms']:>8.2f} {f['max_ms']:>8.1f} {f['errors']:>7} "
              f"{f['rss_after_bytes']['main'] / 2**20:>7.0f} "
              f"{f['server_share_within'].get('5ms', float('nan')) * 100:>10.2f}%")


if __name__ == "__main__":
    main()
