"""Executor overhead per step: plan fetch (with and without prefetch), group lookup, digest check,
and the measurements (``executor.measure``: timing each micro-batch, posting in the background).

Starts a real ``dcp serve`` on loopback, precomputes an epoch for a 4-rank world, then runs 4
gloo ranks (``torch.multiprocessing``) that walk the epoch's steps like a training loop whose
compute is a fixed sleep, timing what the executor adds per step. Prints a table and writes
``--out`` (default ``bench-out/executor_overhead.json``).

Run::

    .venv/bin/python bench/executor_overhead.py --steps 200 --compute-ms 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _service import free_port, start_service, stop_service
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.analytic import analytic_cost_model
from costmodel.presets import load_cluster
from costmodel.specs import ModelSpec
from dcp_cli.progress import progress_bar
from executor.client import PlannerClient, PlanPrefetcher, RetryPolicy
from executor.groups import GroupRegistry
from executor.measure import MeasurementReporter, StepTimer
from executor.runtime import Executor

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
EPOCH = "overhead"


def _precompute(url: str, *, steps: int, samples_per_step: int) -> None:
    spec = ModelSpec(name="ref-llama-bench", kind="1d", num_layers=4, hidden=64, num_heads=4,
                     ffn_hidden=128, vocab=256)
    cluster = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": WORLD,
                                                        "gpus_per_node": WORLD})
    cost_model = analytic_cost_model(spec, cluster.hardware)
    httpx.post(f"{url}/v1/cost-models", json=cost_model.model_dump(mode="json"), timeout=30)
    lines = "\n".join(json.dumps({"id": f"d{i}", "tokens": 64 + (i * 7919) % 4000})
                      for i in range(steps * samples_per_step))
    httpx.post(f"{url}/v1/epochs", timeout=60, json={
        "epoch_id": EPOCH, "manifest_jsonl": lines, "batch": {"samples_per_step": samples_per_step},
        "seed": 0, "cluster": cluster.model_dump(mode="json"), "cost_model_id": cost_model.id,
        "options": {"time_limit_s": 5.0, "use_cpsat": False}}).raise_for_status()
    while True:
        status = httpx.get(f"{url}/v1/epochs/{EPOCH}", timeout=10).json()
        if status["state"] == "done":
            return
        if status["state"] in ("failed", "cancelled"):
            raise RuntimeError(f"epoch failed: {status['error']}")
        time.sleep(0.2)


def _rank(rank: int, port: int, url: str, steps: int, compute_s: float, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
    executor = Executor(registry=registry)
    client = PlannerClient(url, retry=RetryPolicy(deadline_s=30))
    results: dict[str, Any] = {}
    for depth in (4, 0):
        plans = PlanPrefetcher(client, epoch_id=EPOCH, rank=rank, depth=depth, num_steps=steps)
        fetch, digest, total = [], [], []
        dist.barrier()
        for step in range(steps):
            t0 = time.perf_counter()
            rank_plan = plans.get(step)
            t1 = time.perf_counter()
            executor.begin_step(rank_plan, step=step)  # digest all_gather + group lookup
            t2 = time.perf_counter()
            fetch.append(t1 - t0)
            digest.append(t2 - t1)
            total.append(t2 - t0)
            time.sleep(compute_s)  # the step's compute
        plans.close()
        results[f"depth{depth}"] = {"fetch_s": fetch, "digest_s": digest, "total_s": total}
    # Measurements: the timer's calls as the executor makes them (begin_step, start/stop around
    # each micro-batch), the reporter posting every few steps to the service on its thread.
    reporter = MeasurementReporter(client, epoch_id=EPOCH, rank=rank)
    timer = StepTimer(rank=rank, sink=reporter.submit)
    plans = PlanPrefetcher(client, epoch_id=EPOCH, rank=rank, depth=4, num_steps=steps)
    wall, cpu = [], []
    dist.barrier()
    for step in range(steps):
        rank_plan = plans.get(step)
        executor.begin_step(rank_plan, step=step)
        num_micro = max(len(rank_plan.group.micro_batches), 1)
        t0, c0 = time.perf_counter(), time.thread_time()
        timer.begin_step(rank_plan, step=step)
        spent_wall, spent_cpu = time.perf_counter() - t0, time.thread_time() - c0
        for _ in rank_plan.group.micro_batches:
            t0, c0 = time.perf_counter(), time.thread_time()
            timer.start()
            spent_wall += time.perf_counter() - t0
            spent_cpu += time.thread_time() - c0
            time.sleep(compute_s / num_micro)  # the micro-batch's compute
            t0, c0 = time.perf_counter(), time.thread_time()
            timer.stop()
            spent_wall += time.perf_counter() - t0
            spent_cpu += time.thread_time() - c0
        wall.append(spent_wall)
        cpu.append(spent_cpu)
    timer.flush()
    reporter.close(timeout_s=60)
    plans.close()
    results["measure"] = {"wall_s": wall, "thread_cpu_s": cpu, "posted": reporter.num_posted_steps,
                          "dropped": reporter.num_dropped_steps}
    # The digest collective alone, ranks lined up by a barrier first (no peer skew).
    synced = []
    rank_plan = plans.get(steps - 1)
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        executor.begin_step(rank_plan, step=steps - 1)
        synced.append(time.perf_counter() - t0)
    results["synced"] = {"digest_s": synced}
    client.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * p99,
            "max_ms": 1e3 * ordered[-1]}


def main() -> None:
    """Run the benchmark and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples-per-step", type=int, default=16)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="Simulated compute per step.")
    parser.add_argument("--out", type=Path, default=default_out("executor_overhead"))
    parser.add_argument("--quiet", "-q", action="store_true", help="No progress bar: the table only.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name, progress_bar(
            "service + epoch precompute, then the ranks", quiet=args.quiet, total=2) as update:
        tmp = Path(tmp_name)
        proc, url = start_service(tmp)
        try:
            _precompute(url, steps=args.steps, samples_per_step=args.samples_per_step)
            update(1, 2)
            mp.spawn(_rank, args=(free_port(), url, args.steps, args.compute_ms / 1e3, tmp_name),
                     nprocs=WORLD, join=True)
            update(2, 2)
            per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
        finally:
            stop_service(proc, timeout_s=30)
    table: dict[str, Any] = {}
    print(f"executor overhead per step, {WORLD} gloo ranks, {args.steps} steps, "
          f"{args.compute_ms:.0f} ms simulated compute per step")
    print(f"{'mode':<12}{'part':<10}{'median ms':>11}{'p99 ms':>10}{'max ms':>10}")
    for mode in ("depth4", "depth0"):
        table[mode] = {}
        for part in ("fetch_s", "digest_s", "total_s"):
            # Skip step 0 (nothing could be prefetched yet) in the statistics.
            values = [v for r in per_rank for v in r[mode][part][1:]]
            stats = _stats(values)
            table[mode][part.removesuffix("_s")] = stats
            label = "prefetch 4" if mode == "depth4" else "no prefetch"
            print(f"{label:<12}{part.removesuffix('_s'):<10}{stats['median_ms']:>11.3f}"
                  f"{stats['p99_ms']:>10.3f}{stats['max_ms']:>10.3f}")
    for part in ("wall_s", "thread_cpu_s"):
        stats = _stats([v for r in per_rank for v in r["measure"][part]])
        table.setdefault("measure", {})[part.removesuffix("_s")] = stats
        print(f"{'measure':<12}{part.removesuffix('_s'):<10}{stats['median_ms']:>11.3f}"
              f"{stats['p99_ms']:>10.3f}{stats['max_ms']:>10.3f}")
    table["measure"]["posted_steps"] = sum(r["measure"]["posted"] for r in per_rank)
    table["measure"]["dropped_steps"] = sum(r["measure"]["dropped"] for r in per_rank)
    print(f"measurements posted {table['measure']['posted_steps']} rank-steps, dropped "
          f"{table['measure']['dropped_steps']}")
    synced = _stats([v for r in per_rank for v in r["synced"]["digest_s"]])
    table["digest_after_barrier"] = synced
    print(f"{'barrier':<12}{'digest':<10}{synced['median_ms']:>11.3f}{synced['p99_ms']:>10.3f}"
          f"{synced['max_ms']:>10.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        **provenance(), "benchmark": "executor_overhead", "world_size": WORLD, "steps": args.steps,
        "samples_per_step": args.samples_per_step, "compute_ms": args.compute_ms,
        "loadavg": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": table}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
