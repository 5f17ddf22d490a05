"""Is a preset honest to its budget? CPU per plan and the gap to the plan's own bound, per cell.

For each ``WORKLOAD:CLUSTER:SAMPLES`` cell, plans steps ``0 .. --steps - 1`` (seed 0) with
``PlannerConfig.for_budget(--budget)`` (0.05: the default ``PlannerConfig()``) and reports the
CPU p50 (process time of the ``plan_batch`` call, lazy imports warmed first), the mean gap to the
plan's own lower bound and each step's predicted time (to compare plans between commits). Unlike
``bench/plan_quality.py`` it computes no offline LP bound and no baselines table, so a grid of
dozens of cells takes minutes. Where the default cells are chosen: the plan-quality cells (64,
256 and 1,024 samples on h200x32 and h200x64, text and video workloads) and five small batches
where the pattern bound and the cover search run.

Run from the repository root::

    .venv/bin/python bench/plan_budget.py --budget 0.05 --steps 3

It prints a table and writes ``--out`` (default ``bench-out/plan_budget.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.planning import plan_batch_with_stats  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

DEFAULT_CELLS = (
    *(f"{w}:{c}:{n}" for w in ("text-longcontext", "text-longtail", "video-long", "video-short", "video3d-wan")
      for c in ("h200x32", "h200x64") for n in (64, 256, 1024)),
    "video3d-longclip:h200x64:16", "video-long:h200x64:32", "text-longcontext:h200x32:32",
    "text-longtail:h200x32:16", "video-short:h200x32:32")
"""The plan-quality cells of text and video workloads, then small batches (pattern bound, cover)."""


def cell_row(cell: str, *, budget_s: float, steps: int) -> dict[str, Any]:
    """One cell's plans: CPU seconds, gaps and predicted step times per step."""
    workload, cluster_name, num_samples = cell.split(":")
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    config = PlannerConfig.for_budget(budget_s)
    cpus, gaps, times = [], [], []
    for step in range(steps):
        samples = sample_batch(spec, num_samples=int(num_samples), seed=0, step=step)
        start = time.process_time()
        plan, _ = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf, config=config, step=step,
                                        reference_sample=spec.max_sample)
        cpus.append(time.process_time() - start)
        gaps.append(plan.gap)
        times.append(plan.predicted_step_time_s)
    return {"cell": cell, "cpu_p50_s": statistics.median(cpus), "gap_mean": statistics.mean(gaps),
            "cpu_s": cpus, "gaps": gaps, "step_times_s": times}


def main() -> None:
    from provenance import default_out, provenance  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cells", nargs="*", default=list(DEFAULT_CELLS), metavar="WORKLOAD:CLUSTER:SAMPLES")
    parser.add_argument("--out", type=Path, default=default_out("plan_budget"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cell_row("video-long:h200x32:16", budget_s=args.budget, steps=1)  # warm scipy's and OR-Tools' imports
    load_start = os.getloadavg()
    rows = []
    print(f"{'cell':34s}{'CPU p50 ms':>11s}{'gap':>8s}")
    for cell in args.cells:
        row = cell_row(cell, budget_s=args.budget, steps=args.steps)
        rows.append(row)
        print(f"{cell:34s}{row['cpu_p50_s'] * 1e3:11.0f}{row['gap_mean'] * 100:7.2f}%", flush=True)
    result = {**provenance(), "budget_s": args.budget, "steps": args.steps, "seed": 0,
              "machine": {"cpu_count": os.cpu_count(), "loadavg_at_start": load_start,
                          "loadavg_at_end": os.getloadavg()},
              "not_measured": "wall time; one process, unpinned, beside whatever else runs", "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"load {load_start} -> {os.getloadavg()}; wrote {args.out}")


if __name__ == "__main__":
    main()
