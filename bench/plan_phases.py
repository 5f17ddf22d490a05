"""Where one plan's CPU time goes, by planner phase (issue 25: planning speed with layouts chosen).

Plans one batch with a preset (``PlannerConfig.for_budget(--budget, layout=...)``, by default the
50 ms one, ``PlannerConfig()``) while the planner's
phases are wrapped with the process CPU clock: the heuristic and its parts (LPT runs, on-demand
packing, local search), each baseline's draft, costing drafts, the intra pass, the layout choice,
the assembly. Nested phases overlap their parents (``heuristic_plan`` holds ``lpt``); the wrappers
cost a few microseconds per call (``lpt`` is called ~10 times, so the total is the plan's).

Run from the repository root::

    .venv/bin/python bench/plan_phases.py --layout auto --point 16384x131072 --workload text-longtail

It prints a table and writes ``--out`` (default ``bench-out/plan_phases.json``) (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.plan_scale import parse_point  # noqa: E402
from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from planner import planning  # noqa: E402
from planner.baselines import REGISTRY  # noqa: E402
from planner.config import AttentionLayout, PlannerConfig  # noqa: E402
from planner.search import heuristic  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

logger = logging.getLogger("plan_phases")

PLANNING_PHASES = ("prepare", "_search", "_with_ulysses_candidate", "_finish", "heuristic_plan", "intra_draft",
                   "draft_step_time_s", "baseline_drafts", "polish", "choose_group_layouts", "assemble_plan")
"""Names in ``planner.planning`` timed as phases (``_search`` is the search, run once more inside
``_with_ulysses_candidate`` for the Ulysses candidate; ``_finish`` holds the bounds after the search)."""
EXTRA_PHASES = (("planner.bounds.lp", "partition_lp_bound"), ("planner.bounds.patterns", "pattern_bound"),
                ("planner.search.cover", "cover_draft"))
"""Functions ``planner.planning`` imports when it calls them (the extras past the search), timed in
their own modules."""
HEURISTIC_PHASES = ("lpt", "packed_multiset", "local_search", "candidate_multisets", "to_draft")
"""Names in ``planner.search.heuristic`` timed as parts of ``heuristic_plan``."""


def _timed(seconds: dict[str, float], calls: collections.Counter[str], label: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.process_time() - start
            calls[label] += 1
    return wrapper


def plan_phases(*, workload: str, num_gpus: int, num_samples: int, layout: AttentionLayout,
                step: int, budget_s: float = 0.05) -> dict[str, Any]:
    """One plan's CPU seconds in total and per phase, with its step time and gap."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    for name in PLANNING_PHASES:
        setattr(planning, name, _timed(seconds, calls, name, getattr(planning, name)))
    for name in HEURISTIC_PHASES:
        setattr(heuristic, name, _timed(seconds, calls, f"heuristic.{name}", getattr(heuristic, name)))
    for module_name, name in EXTRA_PHASES:
        module = importlib.import_module(module_name)
        setattr(module, name, _timed(seconds, calls, name, getattr(module, name)))
    for baseline in REGISTRY.values():
        object.__setattr__(baseline, "build", _timed(seconds, calls, f"baseline.{baseline.name}", baseline.build))
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster("h200x64").model_copy(update={"num_gpus": num_gpus, "name": f"h200x{num_gpus}"})
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=num_samples, seed=0, step=step)
    start = time.process_time()
    config = PlannerConfig.for_budget(budget_s, layout=layout)
    plan = planning.plan_batch(samples, cluster=cluster, cost_model=cmf, config=config,
                               reference_sample=spec.max_sample)
    total = time.process_time() - start
    phases = [{"phase": k, "cpu_s": v, "calls": calls[k]} for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])]
    return {"workload": workload, "num_gpus": num_gpus, "num_samples": num_samples, "layout": layout, "step": step,
            "budget_s": budget_s,
            "cpu_s": total, "predicted_step_time_s": plan.predicted_step_time_s, "gap": plan.gap,
            "method": plan.solver.method, "phases": phases}


def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="text-longtail")
    parser.add_argument("--point", default="16384x131072", metavar="GPUSxSAMPLES")
    parser.add_argument("--layout", choices=["ulysses", "auto", "ring"], default="auto")
    parser.add_argument("--step", type=int, default=0)
    parser.add_argument("--budget", type=float, default=0.05,
                        help="The preset PlannerConfig.for_budget(BUDGET) (0.05: the default PlannerConfig()).")
    parser.add_argument("--out", type=Path, default=default_out("plan_phases"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gpus, samples = parse_point(args.point)
    load_start = os.getloadavg()
    row = plan_phases(workload=args.workload, num_gpus=gpus, num_samples=samples, layout=args.layout, step=args.step,
                      budget_s=args.budget)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                     capture_output=True, check=False).stdout.strip() or None,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()},
        "not_measured": "wall time; phases nest (heuristic.* inside heuristic_plan, baseline.* inside "
                        "baseline_drafts); one batch, one run",
        **row}
    print(f"{args.workload} {gpus} x {samples}, layout={args.layout}, step {args.step}: CPU {row['cpu_s']:.2f} s, "
          f"step time {row['predicted_step_time_s']:.6f} s, gap {row['gap']:.2%}")
    print(f"{'phase':32s}{'CPU s':>8s}{'calls':>7s}")
    for p in row["phases"]:
        print(f"{p['phase']:32s}{p['cpu_s']:8.3f}{p['calls']:7d}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
