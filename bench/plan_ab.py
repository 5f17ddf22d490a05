"""Predicted step times of the planner's plans over the plan-quality grid, to compare two versions.

Plans every step of the grid of ``bench/plan_quality.py`` (workloads x clusters x batches x
steps, seed 0) with one config and records each plan's predicted step time; no baselines, no LP
bound, so the default grid takes about a minute. With ``--against`` (the JSON of another
version's run, e.g. from a ``git worktree`` of the old commit) it prints, per cell, how many
steps got faster or slower and by how much. The heuristic presets are deterministic (work limits,
no clock, below 0.5 s), so two runs of the same code give the same plans on any load.

Run from the repository root::

    .venv/bin/python bench/plan_ab.py --out /tmp/new.json --against /tmp/old.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plan_quality import LAYOUT_WORKLOADS  # noqa: E402  (bench/, the script's folder)

from costmodel.presets import default_cost_model_file, load_cluster, workload_names  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.planning import plan_batch  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

_SAME = 1e-12


def run_grid(*, workloads: list[str], clusters: list[str], batches: list[int], steps: int,
             config: PlannerConfig) -> dict[str, float]:
    """Predicted step time (s) of each grid step's plan, keyed ``workload|cluster|batch|step``."""
    out: dict[str, float] = {}
    for workload in workloads:
        spec = WorkloadSpec.preset(workload)
        for name in clusters:
            cluster = load_cluster(name)
            cost_model = default_cost_model_file(spec.model, cluster.hardware.name)
            for batch in batches:
                for step in range(steps):
                    samples = sample_batch(spec, num_samples=batch, seed=0, step=step)
                    plan = plan_batch(samples, cluster=cluster, cost_model=cost_model, config=config)
                    out[f"{workload}|{name}|{batch}|{step}"] = plan.predicted_step_time_s
    return out


def compare(new: dict[str, float], old: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per cell (``workload|cluster|batch``): steps faster / slower and the new/old time ratios.

    Raises:
        ValueError: when the two runs planned different steps.
    """
    if new.keys() != old.keys():
        raise ValueError(f"the runs cover different steps ({len(new)} and {len(old)} keys)")
    cells: dict[str, list[float]] = {}
    for key, time_s in new.items():
        cells.setdefault(key.rsplit("|", 1)[0], []).append(time_s / old[key])
    out = {}
    for cell, ratios in cells.items():
        r = np.asarray(ratios)
        out[cell] = {"steps": len(r), "faster": int((r < 1 - _SAME).sum()),
                     "slower": int((r > 1 + _SAME).sum()), "mean_ratio": float(r.mean()),
                     "min_ratio": float(r.min()), "max_ratio": float(r.max())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Where to write this run's times.")
    parser.add_argument("--against", type=Path, default=None, help="Another run's JSON to compare.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workloads", nargs="*", default=None)
    parser.add_argument("--clusters", nargs="*", default=["h200x8", "h200x32", "h200x64"])
    parser.add_argument("--batches", nargs="*", type=int, default=[64, 256, 1024])
    parser.add_argument("--budget-s", type=float, default=None,
                        help="PlannerConfig.for_budget(BUDGET) instead of the default preset (from "
                             "0.5 s the CP-SAT search has a wall-clock cap: not reproducible).")
    args = parser.parse_args()
    config = PlannerConfig() if args.budget_s is None else PlannerConfig.for_budget(args.budget_s)
    grid = args.workloads or [w for w in workload_names() if w not in LAYOUT_WORKLOADS]
    times = run_grid(workloads=grid, clusters=args.clusters,
                     batches=args.batches, steps=args.steps, config=config)
    from provenance import provenance  # bench/, the script's folder, is on sys.path

    args.out.write_text(json.dumps({**provenance(), "budget_s": args.budget_s, "predicted_step_time_s": times},
                                   indent=1))
    if args.against is None:
        return
    old = json.loads(args.against.read_text())["predicted_step_time_s"]
    cells = compare(times, old)
    print(f"{'cell':40s}{'faster':>8s}{'slower':>8s}{'mean new/old':>14s}{'min':>9s}{'max':>9s}")
    for cell, row in cells.items():
        if row["faster"] or row["slower"]:
            print(f"{cell:40s}{row['faster']:8d}{row['slower']:8d}{row['mean_ratio']:14.5f}"
                  f"{row['min_ratio']:9.4f}{row['max_ratio']:9.4f}")
    ratios = np.asarray([times[k] / old[k] for k in times])
    print(f"all {len(ratios)} steps: {int((ratios < 1 - _SAME).sum())} faster, "
          f"{int((ratios > 1 + _SAME).sum())} slower, mean new/old {ratios.mean():.5f}, "
          f"min {ratios.min():.4f}, max {ratios.max():.4f}")


if __name__ == "__main__":
    main()
