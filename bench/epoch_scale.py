"""Epoch precompute throughput: the process pool against Ray, and a projection to 100k steps (issue 14).

Measured on this machine, every run planning the same epoch (same manifest, rule, seed) into a
fresh plan store through ``api.jobs.run_epoch_job``, digests checked equal to the pool's:

* the process pool with 1 and 2 workers;
* a local Ray instance (``ray.init(address="local", num_cpus=2)``) with 1, 4 and 16 steps per task;
* a simulated two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, 1 CPU a node).

Per run: steps/s (wall: the machine is shared, so noisy), the CPU seconds per step of every
process of the run (driver, workers, Ray's daemons; read from /proc), the driver's share
(submitting, collecting, writing the store) and the overhead per step: that CPU minus the CPU of
one step planned serially in this process, and the same against the 2-worker process pool.

Then two steps at scale (1,024 GPUs x 8,192 samples of ``text-longtail``) are planned here:
CPU time, plan bytes, the driver's cost to unpickle a result and to write it to the store (in
transactions of 16 steps) and the store bytes per step. From those and the measured overheads
the wall time of a 100k-step epoch on 64 / 256 / 1,024 CPU workers is *projected* (not
measured: this machine has 2 cores)::

    compute  = steps * (step_cpu_s + worker_overhead_s) / workers   # overhead: Ray run's CPU
                                                                    # outside driver and planner
    driver   = steps * (driver_cpu_s_per_step + unpickle_s + store_write_s)   # one driver process
    wall    ~= max(compute, driver) + 4 * step_cpu_s                         # + the last batch

Run from the repository root (needs ``pip install -e '.[ray]'``)::

    .venv/bin/python bench/epoch_scale.py            # ~3-5 minutes on 2 shared cores
    .venv/bin/python bench/epoch_scale.py --quick    # fewer steps, no 1,024 x 8,192 step

It prints two tables and writes ``--out`` (default ``bench-out/epoch_scale.json``) (load average included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pickle
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import default_out, provenance  # noqa: E402  (bench/, the script's folder, is on sys.path)

from api.jobs import prepare_epoch, run_epoch_job  # noqa: E402
from api.pool import make_executor  # noqa: E402
from api.store import PlanStore  # noqa: E402
from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from costmodel.schema import CostModelFile  # noqa: E402
from costmodel.specs import ClusterSpec, Sample  # noqa: E402
from planner.epoch import BatchRule, StepTask, make_steps, plan_step  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch, synthesize_manifest  # noqa: E402

logger = logging.getLogger("epoch_scale")

WORKLOAD = "text-longtail"
SMALL_CLUSTER = "h200x8"
SAMPLES_PER_STEP = 16
SEED = 3
OPTIONS: dict[str, Any] = {"time_limit_s": 120.0}
"""Default planner settings with a wall cap far from binding (the deterministic budget decides)."""
PROJECTED_STEPS = 100_000
PROJECTED_WORKERS = (64, 256, 1024)
LARGE_GPUS = 1024
LARGE_SAMPLES = 8192
LARGE_STEPS = 2
"""1,024 x 8,192 steps planned here (mean CPU)."""
WRITE_BATCH_STEPS = 16
"""Steps per store transaction (``run_epoch``'s default)."""


def _ray_env(tmp: str) -> None:
    """Ray settings for a throwaway run: no token auth, no usage stats, state under ``tmp``."""
    os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": tmp})


def tree_cpu_s() -> float:
    """CPU seconds of this process and every live descendant (pool or Ray workers, Ray's daemons),
    reaped children included: the machine's work, less sensitive to its load than wall time."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = sum(int(f) for f in fields[11:15]) / ticks  # utime stime cutime cstime
    me = os.getpid()
    total = 0.0
    for pid in cpu:
        p = pid
        while p in parent and p != me and p > 1:
            p = parent[p]
        if p == me:
            total += cpu[pid]
    return total


def _cost_model(cluster: ClusterSpec) -> CostModelFile:
    return default_cost_model_file(WorkloadSpec.preset(WORKLOAD).model, cluster.hardware.name)


def serial_step_cost(samples: list[Sample], cluster: ClusterSpec, num_steps: int) -> dict[str, float]:
    """Mean CPU and wall seconds of ``plan_step`` in this process (no executor), over the same steps."""
    steps = make_steps(samples, rule=BatchRule(samples_per_step=SAMPLES_PER_STEP), seed=SEED)[:num_steps]
    cost_model = _cost_model(cluster)
    plan_step(StepTask.create(step=0, samples=steps[0], cluster=cluster, cost_model=cost_model,
                              options=OPTIONS, seed=SEED))  # imports and caches
    cpu, wall = time.process_time(), time.perf_counter()
    for i, batch in enumerate(steps):
        plan_step(StepTask.create(step=i, samples=batch, cluster=cluster, cost_model=cost_model,
                                  options=OPTIONS, seed=SEED))
    return {"cpu_s": (time.process_time() - cpu) / len(steps), "wall_s": (time.perf_counter() - wall) / len(steps)}


def _warm() -> int:
    """Import the planner in a worker (its first step must not pay for the import)."""
    import planner.planning  # noqa: F401

    time.sleep(0.2)  # keep the worker busy so that the next warm call lands on another one
    return os.getpid()


def warm_pool(pool: Any, workers: int) -> None:
    """Start and warm every worker of a process pool."""
    for future in [pool.submit(_warm) for _ in range(2 * workers)]:
        future.result()


def warm_ray(workers: int) -> None:
    """Start and warm ``workers`` Ray workers."""
    import ray

    ray.get([ray.remote(_warm).remote() for _ in range(2 * workers)])


def run_job(name: str, executor: Any, *, num_workers: int, samples: list[Sample], cluster: ClusterSpec,
            tmp: Path) -> dict[str, Any]:
    """Plan the whole epoch into a fresh store; steps/s, driver CPU per step, digests."""
    db = tmp / f"{name}.sqlite"
    store = PlanStore.open(db)
    prepare_epoch(store, epoch_id="e", samples=samples, rule=BatchRule(samples_per_step=SAMPLES_PER_STEP),
                  seed=SEED, cluster=cluster, cost_model=_cost_model(cluster), options=OPTIONS,
                  manifest_source="bench")
    tree, cpu, wall = tree_cpu_s(), time.process_time(), time.perf_counter()
    final = run_epoch_job(store, "e", get_cost_model=lambda _: _cost_model(cluster), executor=executor,
                          num_workers=num_workers)
    wall_s, cpu_s, tree_s = time.perf_counter() - wall, time.process_time() - cpu, tree_cpu_s() - tree
    store.close()
    if final.state != "done":
        raise RuntimeError(f"{name}: job ended {final.state}: {final.error}")
    with sqlite3.connect(db) as conn:
        digests = [d for (d,) in conn.execute("SELECT digest FROM plans ORDER BY step")]
    return {"runner": name, "steps": final.steps_total, "wall_s": wall_s, "steps_per_s": final.steps_total / wall_s,
            "driver_cpu_s_per_step": cpu_s / final.steps_total, "all_cpu_s_per_step": tree_s / final.steps_total,
            "digests": digests}


def measure_runs(samples: list[Sample], cluster: ClusterSpec, tmp: Path) -> list[dict[str, Any]]:
    """Every runner on the same epoch."""
    from ray.cluster_utils import Cluster

    from api.ray_runner import RayConfig, RayStepExecutor, connect_executor

    rows = []
    for workers in (1, 2):
        pool = make_executor(workers)
        try:
            warm_pool(pool, workers)
            row = run_job(f"pool-{workers}", pool, num_workers=workers, samples=samples, cluster=cluster, tmp=tmp)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        rows.append({**row, "workers": workers, "kind": "process pool"})
    # One local instance for every batch size (started once: its start-up is not per-step cost).
    ray_exec = connect_executor(RayConfig(address="local", local_num_cpus=2, steps_per_task=1))
    try:
        warm_ray(2)
        for steps_per_task in (1, 4, 16):
            executor = RayStepExecutor(RayConfig(address="local", steps_per_task=steps_per_task))
            executor.connect()  # reuses the running instance
            row = run_job(f"ray-local-spt{steps_per_task}", executor, num_workers=0, samples=samples,
                          cluster=cluster, tmp=tmp)
            executor.shutdown()
            rows.append({**row, "workers": 2, "kind": f"ray local, {steps_per_task} step(s)/task"})
    finally:
        ray_exec.shutdown()
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    sim.add_node(num_cpus=1)
    try:
        executor = connect_executor(RayConfig(address=sim.address, steps_per_task=4))
        sim.wait_for_nodes()
        warm_ray(2)
        row = run_job("ray-2nodes-spt4", executor, num_workers=0, samples=samples, cluster=cluster, tmp=tmp)
        executor.shutdown()
        rows.append({**row, "workers": 2, "kind": "ray 2 simulated nodes x 1 CPU, 4 steps/task"})
    finally:
        sim.shutdown()
    return rows


def measure_large_step(tmp: Path) -> dict[str, Any]:
    """One 1,024-GPU x 8,192-sample step: planner CPU, plan bytes, driver-side unpickle and store write."""
    base = load_cluster("h200x64")
    cluster = base.model_copy(update={"num_gpus": LARGE_GPUS, "name": f"h200x{LARGE_GPUS}"})
    spec = WorkloadSpec.preset(WORKLOAD)
    cpus, walls = [], []
    for step in range(LARGE_STEPS):
        samples = sample_batch(spec, num_samples=LARGE_SAMPLES, seed=SEED, step=step)
        task = StepTask.create(step=step, samples=samples, cluster=cluster, cost_model=_cost_model(cluster),
                               options=OPTIONS, seed=SEED)
        cpu, wall = time.process_time(), time.perf_counter()
        result = plan_step(task)
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
    step_cpu_s, step_wall_s = sum(cpus) / len(cpus), sum(walls) / len(walls)
    blob = pickle.dumps(result, protocol=5)
    start = time.perf_counter()
    for _ in range(5):
        pickle.loads(blob)
    unpickle_s = (time.perf_counter() - start) / 5
    store = PlanStore.open(tmp / "large.sqlite")
    many = [Sample(id=f"x{i}", tokens=1) for i in range(WRITE_BATCH_STEPS)]  # the job row only
    prepare_epoch(store, epoch_id="big", samples=many, rule=BatchRule(samples_per_step=1),
                  seed=SEED, cluster=cluster, cost_model=_cost_model(cluster), options=OPTIONS,
                  manifest_source="bench")
    batch = [dataclasses.replace(result, step=i) for i in range(WRITE_BATCH_STEPS)]
    start, start_cpu = time.perf_counter(), time.process_time()
    # One transaction of WRITE_BATCH_STEPS steps, as run_epoch writes them (the plan reused).
    store.write_steps("big", batch)
    write_s = (time.perf_counter() - start) / WRITE_BATCH_STEPS
    write_cpu_s = (time.process_time() - start_cpu) / WRITE_BATCH_STEPS
    store.close()
    db_bytes_per_step = (tmp / "large.sqlite").stat().st_size / WRITE_BATCH_STEPS
    return {"num_gpus": LARGE_GPUS, "num_samples": LARGE_SAMPLES, "step_cpu_s": step_cpu_s,
            "step_wall_s": step_wall_s, "plan_bytes": len(result.plan_json), "pickled_bytes": len(blob),
            "driver_unpickle_s": unpickle_s, "store_write_s": write_s, "store_write_cpu_s": write_cpu_s,
            "store_bytes_per_step": db_bytes_per_step,
            "step_cpu_s_each": cpus, "gap": result.gap}


def project(large: dict[str, Any], runs: list[dict[str, Any]], serial: dict[str, float]) -> list[dict[str, Any]]:
    """Projected wall time of a 100k-step epoch of large steps on many Ray workers (a projection)."""
    ray = next(r for r in runs if r["runner"] == "ray-local-spt4")
    # CPU per step outside the driver and the planner: Ray workers' and daemons' share.
    worker_overhead_s = max(0.0, ray["all_cpu_s_per_step"] - ray["driver_cpu_s_per_step"] - serial["cpu_s"])
    driver_s = ray["driver_cpu_s_per_step"] + large["driver_unpickle_s"] + large["store_write_s"]
    rows = []
    for workers in PROJECTED_WORKERS:
        compute_s = PROJECTED_STEPS * (large["step_cpu_s"] + worker_overhead_s) / workers
        driver_total_s = PROJECTED_STEPS * driver_s
        wall_s = max(compute_s, driver_total_s) + 4 * large["step_cpu_s"]
        rows.append({"cpu_workers": workers, "steps": PROJECTED_STEPS, "compute_s": compute_s,
                     "worker_overhead_s_per_step": worker_overhead_s, "driver_s_per_step": driver_s,
                     "store_bytes": PROJECTED_STEPS * large["store_bytes_per_step"],
                     "driver_s": driver_total_s, "projected_wall_s": wall_s,
                     "bound": "driver" if driver_total_s > compute_s else "workers",
                     "result_bytes_per_s": PROJECTED_STEPS * large["pickled_bytes"] / wall_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=160, help="Steps of the measured epoch.")
    parser.add_argument("--quick", action="store_true", help="40 steps; no 1,024 x 8,192 step.")
    parser.add_argument("--out", type=Path, default=default_out("epoch_scale"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    num_steps = 40 if args.quick else args.steps
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dcpes", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        _ray_env(str(tmp / "ray"))
        (tmp / "ray").mkdir()
        cluster = load_cluster(SMALL_CLUSTER)
        samples = synthesize_manifest(WorkloadSpec.preset(WORKLOAD), num_samples=num_steps * SAMPLES_PER_STEP,
                                      seed=SEED)
        serial = serial_step_cost(samples, cluster, num_steps)
        logger.info("serial step: %.1f ms CPU, %.1f ms wall", 1e3 * serial["cpu_s"], 1e3 * serial["wall_s"])
        runs = measure_runs(samples, cluster, tmp)
        large = None if args.quick else measure_large_step(tmp)
    reference = runs[0]["digests"]
    print(f"\nEpoch of {num_steps} steps ({WORKLOAD}, {SAMPLES_PER_STEP} samples/step, {SMALL_CLUSTER}); serial "
          f"step {1e3 * serial['cpu_s']:.1f} ms CPU / {1e3 * serial['wall_s']:.1f} ms wall; load {load_start}")
    print("CPU ms/step: every process of the run (driver, workers, Ray daemons); overhead = that minus the "
          "serial step's CPU; vs pool = overhead minus the 2-worker pool's")
    print(f"{'runner':<46} {'wkrs':>4} {'steps/s':>8} {'CPU ms/step':>11} {'overhead':>8} {'vs pool':>8} "
          f"{'driver':>7} {'digests':>8}")
    pool2 = next(r for r in runs if r["runner"] == "pool-2")
    pool2_overhead_s = pool2["all_cpu_s_per_step"] - serial["cpu_s"]
    for r in runs:
        r["overhead_cpu_s_per_step"] = r["all_cpu_s_per_step"] - serial["cpu_s"]
        r["overhead_vs_pool_cpu_s_per_step"] = r["overhead_cpu_s_per_step"] - pool2_overhead_s
        r["digests_equal_pool"] = r["digests"] == reference
        print(f"{r['kind']:<46} {r['workers']:>4} {r['steps_per_s']:>8.1f} {1e3 * r['all_cpu_s_per_step']:>11.1f} "
              f"{1e3 * r['overhead_cpu_s_per_step']:>8.1f} {1e3 * r['overhead_vs_pool_cpu_s_per_step']:>+8.1f} "
              f"{1e3 * r['driver_cpu_s_per_step']:>7.2f} {'equal' if r['digests_equal_pool'] else 'DIFFER':>8}")
    projection = None
    if large is not None:
        projection = project(large, runs, serial)
        print(f"\nOne {LARGE_GPUS} x {LARGE_SAMPLES} step: {large['step_cpu_s']:.1f} s CPU, plan "
              f"{large['plan_bytes'] / 1e6:.2f} MB, driver unpickle {1e3 * large['driver_unpickle_s']:.1f} ms, "
              f"store write {1e3 * large['store_write_s']:.1f} ms ({1e3 * large['store_write_cpu_s']:.1f} ms CPU) "
              f"and {large['store_bytes_per_step'] / 1e6:.2f} MB "
              f"per step (transactions of {WRITE_BATCH_STEPS})")
        print(f"PROJECTION (not measured) of a {PROJECTED_STEPS:,}-step epoch of such steps:")
        print(f"{'CPU workers':>11} {'compute h':>10} {'driver h':>9} {'wall h':>8} {'bound':>8} "
              f"{'MB/s to driver':>15} {'store GB':>9}")
        for p in projection:
            print(f"{p['cpu_workers']:>11} {p['compute_s'] / 3600:>10.2f} {p['driver_s'] / 3600:>9.2f} "
                  f"{p['projected_wall_s'] / 3600:>8.2f} {p['bound']:>8} {p['result_bytes_per_s'] / 1e6:>15.1f} "
                  f"{p['store_bytes'] / 1e9:>9.0f}")
    for r in runs:
        del r["digests"]
    record = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "workload": WORKLOAD,
              "cluster": SMALL_CLUSTER, "samples_per_step": SAMPLES_PER_STEP, "steps": num_steps,
              "options": OPTIONS, "serial_step": serial, "runs": runs, "large_step": large,
              "projection": projection, "projection_note": "projected from the measured step cost and "
              "overheads, not measured: compute = steps*(step_cpu+worker_overhead)/workers, driver = "
              "steps*(driver_cpu_per_step+unpickle+store_write), wall ~ max(compute, driver) + last batch"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), **record}, indent=1) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
