"""The partition LP bound is limited by work (simplex iterations, branch-and-bound nodes), never by
the clock: computed in a process whose clock runs fifteen times slower than its work (stopped 14
of every 15 ms while it solves, with two busy processes beside it), it is the same float as
computed at full speed. With the former 2-second wall limit per solve, the whole-group MIP's
largest solve on this batch (0.45 s CPU, proven infeasible) ran past it there and counted as
feasible, so the bound (part of the plan's digest) came out different (checked by restoring it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BOUND_SCRIPT = """
from costmodel.presets import default_cost_model_file, load_cluster
from planner.bounds.lp import partition_lp_bound
from planner.config import PlannerConfig
from planner.planning import prepare
from planner.workload import WorkloadSpec, sample_batch
spec = WorkloadSpec.preset("text-longcontext")
cluster = load_cluster("h200x64")
samples = sample_batch(spec, num_samples=128, seed=0, step=0)
prep = prepare(samples, cluster=cluster, cost_model=default_cost_model_file(spec.model, cluster.hardware.name),
               config=PlannerConfig())
print("ready", flush=True)
print(repr(partition_lp_bound(prep.table, lower_s=prep.bounds.compute_makespan_s, iterations=3,
                              integral_groups=True, micro_batch_buckets=2)))
"""


def _bound(*, slowed: bool) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", BOUND_SCRIPT], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    hogs = []
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()  # imports and the cost table at full speed
        if slowed and ready.strip() == "ready":  # the bound: two busy processes beside it, 1 ms of every 15
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
            while proc.poll() is None:
                os.kill(proc.pid, signal.SIGSTOP)
                time.sleep(0.014)
                os.kill(proc.pid, signal.SIGCONT)
                time.sleep(0.001)
        out, err = proc.communicate()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    return float(out.strip().splitlines()[-1])


def test_the_lp_bound_is_the_same_with_a_slowed_clock() -> None:
    quiet = _bound(slowed=False)
    assert quiet > 0
    assert _bound(slowed=True) == quiet
