"""Planner latency of the default preset on one CPU core, optionally A/B against another checkout.

For every cell ``workload:cluster:samples`` it plans ``--steps`` seeded batches
(``planner.workload.sample_batch``, seed 0, steps 0..n-1) with ``PlannerConfig()`` and reports
the CPU time (``time.process_time``) of ``plan_batch``: the minimum of ``--reps`` runs per step,
then p50 / p95 over the steps. With ``--baseline DIR`` (the repository root of another
checkout, e.g. ``git archive <commit> | tar -x -C DIR``) a second worker process plans the same
steps with that checkout's planner, and the two alternate run by run (A, B, B, A, ...) on the
same pinned core, so both see the same machine; it also reports whether each step's
``Plan.content_digest`` is the same on both sides (same plan). The planners run in worker
processes pinned with ``taskset`` to ``--cpu``.

Run from the repository root::

    .venv/bin/python bench/plan_latency.py                       # this checkout only
    .venv/bin/python bench/plan_latency.py --baseline /tmp/base   # A = /tmp/base, B = here

It prints a table and writes ``--out`` (default ``bench-out/plan_latency.json``) (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("video-short", "video-balanced", "video-long", "text-longtail", "text-longcontext")
DEFAULT_CELLS = tuple(f"{w}:h200x32:256" for w in WORKLOADS) + tuple(
    f"{w}:h200x64:1024" for w in WORKLOADS)


def _worker(root: str) -> None:
    """Plan ``cell step`` requests from stdin with the planner under ``root``; one JSON line each."""
    sys.path.insert(0, root)
    from costmodel.presets import default_cost_model_file, load_cluster
    from planner.config import PlannerConfig
    from planner.planning import plan_batch
    from planner.workload import WorkloadSpec, sample_batch

    config = PlannerConfig()
    cells: dict[str, Any] = {}
    for line in sys.stdin:
        cell, step_text = line.split()
        step = int(step_text)
        if cell not in cells:
            workload, cluster_name, num_samples = cell.split(":")
            spec = WorkloadSpec.preset(workload)
            cluster = load_cluster(cluster_name)
            cells[cell] = (spec, cluster, default_cost_model_file(spec.model, cluster.hardware.name),
                           int(num_samples), {})
        spec, cluster, cmf, num_samples, batches = cells[cell]
        if step not in batches:
            batches[step] = sample_batch(spec, num_samples=num_samples, seed=0, step=step)
        start = time.process_time()
        plan = plan_batch(batches[step], cluster=cluster, cost_model=cmf, config=config, step=step,
                          reference_sample=spec.max_sample)
        cpu_s = time.process_time() - start
        sys.stdout.write(json.dumps({"cpu_s": cpu_s, "digest": plan.content_digest()}) + "\n")
        sys.stdout.flush()


class _Side:
    """A worker process planning with the checkout at ``root``."""

    def __init__(self, root: Path, cpu: int) -> None:
        self.root = root
        # Pinned with taskset where there is one (unpinned otherwise).
        pin = ["taskset", "-c", str(cpu)] if shutil.which("taskset") else []
        self.proc = subprocess.Popen(
            [*pin, sys.executable, str(Path(__file__).resolve()), "--worker", str(root)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def plan(self, cell: str, step: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{cell} {step}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.root} exited (cell {cell}, step {step})")
        return dict(json.loads(line))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def _commit(root: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or None if out.returncode == 0 else None


def _summary(times_s: list[float]) -> dict[str, float]:
    return {"p50_ms": float(np.median(times_s) * 1e3),
            "p95_ms": float(np.percentile(times_s, 95) * 1e3)}


def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS),
                        help="workload:cluster:samples (default: 5 workloads x 256 x h200x32 "
                             "and 1024 x h200x64)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3, help="runs per step (the minimum counts)")
    parser.add_argument("--cpu", type=int, default=1, help="core the workers are pinned to")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="repository root of another checkout to compare against (A)")
    parser.add_argument("--baseline-commit", default=None,
                        help="commit of the --baseline tree, for the record (when it has no .git)")
    parser.add_argument("--out", type=Path, default=default_out("plan_latency"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker)
        return
    if args.steps < 1 or args.reps < 1:
        raise ValueError(f"--steps and --reps must be at least 1, got {args.steps}, {args.reps}")
    sides = {"b": _Side(ROOT, args.cpu)}
    if args.baseline is not None:
        sides["a"] = _Side(args.baseline.resolve(), args.cpu)
    result: dict[str, Any] = {
        "load_avg_start": os.getloadavg(), "cpu": args.cpu, "steps": args.steps, "reps": args.reps,
        "b": {"root": str(ROOT), "commit": _commit(ROOT)},
        "a": None if args.baseline is None else {
            "root": str(args.baseline), "commit": args.baseline_commit or _commit(args.baseline)},
        "cells": {}}
    order = ["a", "b"] if "a" in sides else ["b"]
    for cell in args.cells:
        for side in sides.values():
            side.plan(cell, 0)  # warm-up: imports, cost-model files
        times: dict[str, list[float]] = {k: [] for k in sides}
        same = 0
        for step in range(args.steps):
            runs: dict[str, list[float]] = {k: [] for k in sides}
            digests: dict[str, str] = {}
            for rep in range(args.reps):
                for key in (order if rep % 2 == 0 else order[::-1]):
                    out = sides[key].plan(cell, step)
                    runs[key].append(out["cpu_s"])
                    digests[key] = out["digest"]
            for key in sides:
                times[key].append(min(runs[key]))
            same += len(set(digests.values())) == 1
        row: dict[str, Any] = {key: {"cpu_ms": [t * 1e3 for t in times[key]], **_summary(times[key])}
                               for key in sides}
        if "a" in sides:
            row["same_digests"] = same
        result["cells"][cell] = row
        line = f"{cell:32s}"
        if "a" in sides:
            line += f" A p50 {row['a']['p50_ms']:6.1f} p95 {row['a']['p95_ms']:6.1f} |"
        line += f" B p50 {row['b']['p50_ms']:6.1f} p95 {row['b']['p95_ms']:6.1f} ms"
        if "a" in sides:
            line += (f" | B/A {row['b']['p50_ms'] / row['a']['p50_ms']:.2f}"
                     f" | same plan {same}/{args.steps}")
        print(line, flush=True)
    for side in sides.values():
        side.close()
    result["load_avg_end"] = os.getloadavg()
    print(f"load average {result['load_avg_start']} -> {result['load_avg_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from provenance import provenance  # bench/, the script's folder, is on sys.path

    args.out.write_text(json.dumps({**provenance(), **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
