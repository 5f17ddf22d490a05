"""Attention layouts chosen per group against layouts forced for the whole plan (issue 25).

On the long-context presets (``text-millionctx``: Llama-3.1-8B with 5% of documents at 256k-1M
tokens; ``video3d-longclip``: Wan2.1-1.3B, 12 heads, clips of 20k-148k tokens) and one mixed
workload (``text-longcontext`` under Llama-3.1-8B: log-uniform 1k-256k tokens), every seeded
batch is planned three times: the planner choosing each group's layout ``u x r`` (``auto``), and
forced to pure Ulysses (``ulysses``: groups stop at the heads) and to pure ring (``ring``). Per
mode: predicted step time, speedup over the strongest baseline of the step (the registry's,
``ring-cp`` and ``usp`` included, each where it holds the batch), the gap to the plan's own lower
bound, groups past the heads, whether the validator accepts the plan; a mode that cannot plan a
step (no layout of its kind holds a sample) is reported as infeasible there, not dropped.

Run from the repository root (``bench/plan_quality.py --layouts`` runs the same)::

    .venv/bin/python bench/plan_quality_layouts.py --steps 5 --batches 16 64 256

It prints a table and writes ``--out`` (default ``bench-out/plan_quality_layouts.json``, not
the main grid's ``plan_quality.json``). Predictions of the analytic cost model only: nothing here
runs a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from provenance import default_out, provenance  # noqa: E402  (bench/, the script's folder, is on sys.path)

from costmodel.evaluate import CostModel  # noqa: E402
from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from planner.baselines import REGISTRY, strongest  # noqa: E402
from planner.config import AttentionLayout, PlannerConfig  # noqa: E402
from planner.planning import plan_batch_with_stats  # noqa: E402
from planner.validate import validate_plan  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

MODES: tuple[AttentionLayout, ...] = ("auto", "ulysses", "ring")
"""Layout choice per group (``auto``) and the two forced for every group."""

WORKLOADS = ("text-millionctx", "video3d-longclip", "text-longcontext@llama-3.1-8b")
"""The two long-context presets and the mixed workload."""

BASELINES = ("ring-cp", "usp", "static-best", "megatron-dyncp", "dcp-greedy", "strongest")
"""Baseline columns of the table (every registered one is in the JSON)."""



DEFAULT_BUDGET_S = 0.05
"""The planner's default preset: ``dcp plan``'s ``--budget-ms 50`` (``PlannerConfig.for_budget``)."""


def layout_config(mode: AttentionLayout, base: PlannerConfig | None = None) -> PlannerConfig:
    """The planner's configuration (default: the preset of ``DEFAULT_BUDGET_S``) with its attention
    layout set to ``mode``; bounds not strict: a lower bound above a valid plan is dropped and
    recorded (``SearchStats.dropped_bounds``), not fatal, so that one wrong bound does not hide
    the other steps."""
    return dataclasses.replace(base or PlannerConfig.for_budget(DEFAULT_BUDGET_S, strict_bounds=False), layout=mode)


def _mode_row(plan: Any, stats: Any, samples: list[Any], cost_model: CostModel, heads: int,
              cpu_s: float) -> dict[str, Any]:
    problems = validate_plan(plan, samples, cost_model=cost_model)
    layouts = sorted(((g.size, g.ring_degree) for g in plan.groups if g.micro_batches), reverse=True)
    return {
        "feasible": True, "step_time_s": plan.predicted_step_time_s, "bound_s": plan.lower_bound.value_s,
        "bound_kind": plan.lower_bound.kind, "gap": plan.gap, "status": plan.solver.status,
        "method": plan.solver.method, "cpu_s": cpu_s, "valid": not problems, "problems": problems[:3],
        "layouts": [f"{d // r}x{r}" for d, r in layouts],
        "groups_past_heads": sum(d > heads for d, _ in layouts),
        "ring_groups": sum(r > 1 for _, r in layouts),
        "baselines_s": dict(plan.baselines_s), "dropped_bounds": list(stats.dropped_bounds),
        "baselines_not_holding": list(stats.baselines_not_holding),
    }


def run_cell(workload: str, cluster_name: str, num_samples: int, steps: int, *, seed: int = 0,
             config: PlannerConfig | None = None) -> dict[str, Any]:
    """Plan ``steps`` batches of one workload in every mode; per-step rows and a summary.

    ``workload``: a preset, or ``NAME@MODEL`` for its samples under another model preset.
    """
    name, _, model = workload.partition("@")
    spec = WorkloadSpec.preset(name)
    if model:
        spec = spec.model_copy(update={"model": model})
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    cost_model = CostModel(file=cmf, cluster=cluster)
    heads = cmf.model.num_heads
    rows = []
    for step in range(steps):
        samples = sample_batch(spec, num_samples=num_samples, seed=seed, step=step)
        row: dict[str, Any] = {"step": step, "max_tokens": max(s.tokens for s in samples),
                               "tokens": sum(s.tokens for s in samples)}
        for mode in MODES:
            cpu = time.process_time()
            try:
                plan, stats = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf,
                                                config=layout_config(mode, config), step=step,
                                                reference_sample=spec.max_sample)
            except ValueError as exc:  # no layout of this mode holds some sample
                row[mode] = {"feasible": False, "reason": str(exc)[:300]}
                continue
            row[mode] = _mode_row(plan, stats, samples, cost_model, heads, time.process_time() - cpu)
        # The baselines do not depend on the mode: the first feasible mode's.
        base = next((dict(row[m]["baselines_s"]) for m in MODES if row[m]["feasible"]), {})
        best = strongest(base)
        if best is not None:
            base["strongest"] = best[1]
        row["baselines_s"] = base
        row["strongest"] = best[0] if best else None
        row["not_holding"] = next((sorted(row[m]["baselines_not_holding"]) for m in MODES if row[m]["feasible"]), [])
        rows.append(row)
    return {"summary": summarise(workload, cluster_name, num_samples, rows, heads=heads), "rows": rows}


def summarise(workload: str, cluster_name: str, num_samples: int, rows: list[dict[str, Any]], *,
              heads: int) -> dict[str, Any]:
    """Per mode over the steps: feasible and valid steps, mean step time, speedup over the
    strongest baseline (mean of per-step ratios, and total baseline time / total plan time), mean
    gap to the plan's bound; ``auto`` against each forced mode on the steps both planned."""
    out: dict[str, Any] = {"workload": workload, "cluster": cluster_name, "num_samples": num_samples,
                           "steps": len(rows), "heads": heads}
    for mode in MODES:
        ok = [r for r in rows if r[mode]["feasible"]]
        vs = [r for r in ok if r["strongest"] is not None]
        out[mode] = {
            "feasible_steps": len(ok), "valid_steps": sum(r[mode]["valid"] for r in ok),
            "step_time_mean_s": float(np.mean([r[mode]["step_time_s"] for r in ok])) if ok else None,
            "speedup_strongest_mean": (float(np.mean([r["baselines_s"]["strongest"] / r[mode]["step_time_s"]
                                                      for r in vs])) if vs else None),
            "speedup_strongest_total": (sum(r["baselines_s"]["strongest"] for r in vs)
                                        / sum(r[mode]["step_time_s"] for r in vs)) if vs else None,
            "gap_mean": float(np.mean([r[mode]["gap"] for r in ok])) if ok else None,
            "groups_past_heads_steps": sum(r[mode]["groups_past_heads"] > 0 for r in ok),
            # Steps where a lower bound came out above the (valid) plan and was dropped: a wrong bound.
            "dropped_bound_steps": sum(bool(r[mode]["dropped_bounds"]) for r in ok),
            "statuses": dict(Counter(r[mode]["status"] for r in ok)),
            "ring_groups_mean": float(np.mean([r[mode]["ring_groups"] for r in ok])) if ok else None,
            "cpu_p50_s": float(np.median([r[mode]["cpu_s"] for r in ok])) if ok else None,
        }
        # Against the strongest baseline the mode itself allows (its own layouts: forced Ulysses
        # keeps ring-cp and usp out, forced ring keeps usp out).
        own = [(best[1], r[mode]["step_time_s"]) for r in ok
               if (best := strongest(r[mode]["baselines_s"])) is not None]
        out[mode]["speedup_own_strongest_mean"] = float(np.mean([b / t for b, t in own])) if own else None
        for name in BASELINES[:-1]:
            held = [r for r in ok if name in r["baselines_s"]]
            out[mode][f"speedup_{name}_mean"] = (float(np.mean([r["baselines_s"][name] / r[mode]["step_time_s"]
                                                                for r in held])) if held else None)
    for forced in MODES[1:]:
        both = [r for r in rows if r["auto"]["feasible"] and r[forced]["feasible"]]
        out[f"auto_over_{forced}_mean"] = (float(np.mean([r[forced]["step_time_s"] / r["auto"]["step_time_s"]
                                                          for r in both])) if both else None)
    out["baselines_not_holding"] = {n: sum(n in r["not_holding"] for r in rows)
                                    for n in REGISTRY if any(n in r["not_holding"] for r in rows)}
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(cells: list[dict[str, Any]]) -> None:
    """One line per workload and mode."""
    head = (f"{'workload':30s}{'batch':>6s}{'mode':>8s}{'ok/valid':>9s}{'step s':>9s}{'x strong':>9s}{'x own':>7s}"
            f"{'x ringcp':>9s}{'x usp':>7s}{'gap':>8s}{'drop':>5s}{'past':>5s}{'auto x':>7s}")
    print(head)
    print("-" * len(head))
    for cell in cells:
        s = cell["summary"]
        for mode in MODES:
            m = s[mode]
            step = "-" if m["step_time_mean_s"] is None else f"{m['step_time_mean_s']:.3f}"
            gap = "-" if m["gap_mean"] is None else f"{m['gap_mean'] * 100:.2f}%"
            print(f"{s['workload']:30s}{s['num_samples']:>6d}{mode:>8s}{m['feasible_steps']:>4d}/{m['valid_steps']:<4d}{step:>9s}"
                  f"{_x(m['speedup_strongest_mean']):>9s}{_x(m['speedup_own_strongest_mean']):>7s}"
                  f"{_x(m['speedup_ring-cp_mean']):>9s}{_x(m['speedup_usp_mean']):>7s}{gap:>8s}"
                  f"{m['dropped_bound_steps']:>5d}{m['groups_past_heads_steps']:>5d}"
                  f"{_x(s.get(f'auto_over_{mode}_mean')):>7s}")
    print("x strong: over the strongest baseline of the step under layout=auto (ring-cp, usp included); x own: "
          "over the strongest the mode allows; drop: steps where a lower bound above the plan was dropped; past: "
          "steps with a group past the heads; auto x: this mode's step time / auto's")


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run every workload, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    parser.add_argument("--cluster", default="h200x64")
    parser.add_argument("--batches", nargs="*", type=int, default=[16, 64, 256], help="Samples per step.")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-ms", type=float, default=DEFAULT_BUDGET_S * 1000,
                        help="The planner preset's budget (PlannerConfig.for_budget), as dcp plan's --budget-ms.")
    parser.add_argument("--out", type=Path, default=default_out("plan_quality_layouts"))
    args = parser.parse_args(argv)

    result: dict[str, Any] = {
        **provenance(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "config": f"PlannerConfig.for_budget({args.budget_ms / 1000:g}, strict_bounds=False) with layout per mode",
        "cluster": args.cluster, "batches": args.batches, "steps": args.steps, "seed": args.seed,
        "workloads": args.workloads, "modes": list(MODES),
    }
    base = PlannerConfig.for_budget(args.budget_ms / 1000, strict_bounds=False)
    cells = [run_cell(w, args.cluster, b, args.steps, seed=args.seed, config=base)
             for w in args.workloads for b in args.batches]
    print_table(cells)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["cells"] = cells
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
