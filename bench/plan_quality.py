"""Plan quality and planner latency over the workload presets (issues 3 and 10).

For every workload x cluster x global batch size, plans ``--steps`` seeded batches and reports:
speedup over every baseline (``planner/baselines/``: bucket parallel at SP 1/2/4/8 and the best
of them per cell, static-best, megatron-dyncp, dcp-greedy, naive) and over the strongest
baseline of each step (naive excepted), with the ceiling ``strongest / bound`` (what a plan at
the bound would gain); the steps by status (the search's own HEURISTIC/FEASIBLE/OPTIMAL, a
BASELINE as it is, a POLISHED_BASELINE), the share where the search alone beat the strongest
baseline and the gain of polishing; the gap to the lower bound
the plan reports (mean, p95), and to the partition LP bound (``planner.bounds.lp``) computed
offline, outside the timed call, also on compute alone (gradient sync off both sides); planner
latency (p50, p95) on one CPU core. Then the quality reached at 50 ms / 200 ms / 1 s budgets
(256 samples, 32 GPUs) with the share of steps where CP-SAT (the large-neighbourhood search)
improved the heuristic's plan and by how much; the DCP-intra ablation (inter-step search only
against inter + intra, ``--ablation-batch``); and the planner's peak RSS for 1024 samples at
64 GPUs (measured in a fresh process). Latency is reported as wall time and as the process's
CPU time: on a shared machine the CPU time is the better estimate of the single-core latency.

Run from the repository root::

    .venv/bin/python bench/plan_quality.py --quick          # a few minutes
    .venv/bin/python bench/plan_quality.py                  # the full grid (20 steps per cell)
    .venv/bin/python bench/plan_quality.py --workloads video3d-wan text-longtail@llama-3.1-8b \
        text-longcontext@llama-3.1-8b --clusters h200x32 h200x64 --batches 256 --steps 5 \
        --budgets --ablation-batch 0 --out bench/results/plan_quality_modern.json   # modern models
    .venv/bin/python bench/plan_quality.py --workloads text-longtail@gpt-oss-20b \
        text-longtail@gpt-oss-120b text-longtail@qwen3-30b-a3b --clusters h200x64 --batches 64 256 \
        --steps 5 --budgets --ablation-batch 0 --expert-parallel 8 \
        --out bench/results/plan_quality_moe.json   # mixture-of-experts and windowed models

(Gemma-3-27B is left out: its bf16 parameters and gradients alone, 108 GB, are over an H200's cap
under the state shardings the executor runs.)

It prints tables and writes ``--out`` (default ``bench-out/plan_quality[_quick].json``).
``--layouts`` runs the attention-layout comparison of issue 25 instead
(``bench/plan_quality_layouts.py``, default ``bench-out/plan_quality_layouts.json``)::

    .venv/bin/python bench/plan_quality.py --layouts --steps 5 --batches 16 64 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
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

from costmodel.presets import default_cost_model_file, load_cluster, load_model, workload_names  # noqa: E402
from dcp_cli.progress import make_progress  # noqa: E402
from planner.baselines import strongest  # noqa: E402
from planner.bounds.lp import partition_lp_bound  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.planning import check_bound, plan_batch_with_stats, prepare  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

BUCKETS = ("bucket-sp1", "bucket-sp2", "bucket-sp4", "bucket-sp8")
BASELINES = (*BUCKETS, "bucket-best", "static-best", "megatron-dyncp", "dcp-greedy", "naive",
             "strongest")
"""Speedup columns: the registry's baselines, the best bucket size of the cell, the strongest."""

LAYOUT_WORKLOADS = ("text-millionctx", "video3d-longclip")
"""Presets of the attention-layout comparison (``--layouts``, bench/plan_quality_layouts.py),
left out of the default grid: their longest samples need groups past the heads (ring layouts),
which the grid's Ulysses-era plans and baselines cannot hold on 8 GPUs."""


def _pin(cpu: int | None) -> str:
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return "unpinned"
    os.sched_setaffinity(0, {cpu})
    return f"cpu {cpu}"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_cell(workload: str, cluster_name: str, num_samples: int, steps: int,
             config: PlannerConfig, seed: int = 0, lp_bound: bool = True,
             expert_parallel_size: int = 1) -> dict[str, Any]:
    """Plan ``steps`` batches of one cell; summary and per-step rows. ``workload`` is a preset
    name, or ``NAME@MODEL`` for its samples under another model preset (``text-longtail@llama-3.1-8b``).
    ``expert_parallel_size`` splits a mixture-of-experts model's experts (dense models ignore it)."""
    name, _, model = workload.partition("@")
    spec = WorkloadSpec.preset(name)
    if model:
        spec = spec.model_copy(update={"model": model})
    experts = load_model(spec.model).num_experts
    cluster = load_cluster(cluster_name, **({"expert_parallel_size": expert_parallel_size}
                                            if experts and expert_parallel_size > 1 else {}))
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    rows = []
    for step in range(steps):
        samples = sample_batch(spec, num_samples=num_samples, seed=seed, step=step)
        start, cpu_start = time.perf_counter(), time.process_time()
        plan, stats = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf,
                                            config=config, step=step,
                                            reference_sample=spec.max_sample)
        latency, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        best = strongest(plan.baselines_s)
        # Offline, untimed: the partition LP bound (planner.bounds.lp, whole group counts) on
        # the steps whose gap is over 2%, for the gap to the tightest bound we can prove; the
        # plan itself is unchanged. (Skipped below 2%: ~0.3 s per solve at 1024 samples.)
        bound_lp = plan.lower_bound.value_s
        if lp_bound and plan.gap > 0.02 and plan.solver.status != "OPTIMAL":
            table = prepare(samples, cluster=cluster, cost_model=cmf, config=config).table
            sync = table.grad_sync_s
            # (the bounds' view: with rings, the table's own times are upper bounds of a sample's share)
            bound_lp = max(bound_lp, sync + partition_lp_bound(
                table.for_bounds(), lower_s=bound_lp - sync, iterations=6, integral_groups=True))
            check_bound(bound_lp, "partition-lp (offline)", plan.predicted_step_time_s,
                        status=plan.solver.status)
        sync = plan.grad_sync_time_s
        rows.append({
            "bound_lp_s": bound_lp, "gap_lp": plan.predicted_step_time_s / bound_lp - 1,
            # The same gap on compute alone (gradient sync taken off both sides).
            "gap_lp_compute": (plan.predicted_step_time_s - sync) / (bound_lp - sync) - 1,
            "heuristic_step_time_s": stats.heuristic_step_time_s,
            "cpsat_step_time_s": stats.cpsat_step_time_s, "cpsat_improved": stats.cpsat_improved,
            "lns_rounds": stats.lns_rounds, "lns_improved_rounds": stats.lns_improved_rounds,
            # The search's own plan (before any baseline) against the strongest baseline, and what
            # polishing a winning baseline gained.
            "search_step_time_s": stats.search_step_time_s,
            "search_beat_strongest": bool(best is not None and stats.search_step_time_s < best[1] * (1 - 1e-9)),
            "polish_gain": (stats.polished_from_s / plan.predicted_step_time_s
                            if stats.polished_from_s is not None else None),
            "step": step, "step_time_s": plan.predicted_step_time_s,
            "bound_s": plan.lower_bound.value_s, "bound_kind": plan.lower_bound.kind,
            "gap": plan.gap, "status": plan.solver.status, "method": plan.solver.method,
            "latency_s": latency, "cpu_s": cpu,
            "baselines_s": {**plan.baselines_s, **({"strongest": best[1]} if best else {})},
            "strongest": best[0] if best else None,
            "group_sizes": sorted((g.size for g in plan.groups), reverse=True),
        })
    summary: dict[str, Any] = {
        "workload": workload, "cluster": cluster_name, "num_samples": num_samples,
        "steps": steps,
        "gap_mean": float(np.mean([r["gap"] for r in rows])),
        "gap_p95": _pct([r["gap"] for r in rows], 95),
        "gap_max": float(max(r["gap"] for r in rows)),
        "gap_lp_mean": float(np.mean([r["gap_lp"] for r in rows])),
        "gap_lp_p95": _pct([r["gap_lp"] for r in rows], 95),
        "gap_lp_compute_mean": float(np.mean([r["gap_lp_compute"] for r in rows])),
        "gap_lp_compute_p95": _pct([r["gap_lp_compute"] for r in rows], 95),
        # The most any plan could gain over the strongest baseline: strongest / bound.
        "ceiling_strongest_mean": float(np.mean([r["baselines_s"]["strongest"] / r["bound_lp_s"]
                                                 for r in rows if "strongest" in r["baselines_s"]])),
        "methods": dict(Counter(r["method"] for r in rows)),
        "cpsat_improved_share": float(np.mean([r["cpsat_improved"] for r in rows])),
        "cpsat_gain_mean": float(np.mean([r["heuristic_step_time_s"] / r["step_time_s"]
                                          for r in rows if r["cpsat_improved"]] or [1.0])),
        "cpsat_gain_max": float(max([r["heuristic_step_time_s"] / r["step_time_s"]
                                     for r in rows if r["cpsat_improved"]] or [1.0])),
        "lns_rounds": int(sum(r["lns_rounds"] for r in rows)),
        "lns_improved_rounds": int(sum(r["lns_improved_rounds"] for r in rows)),
        "bound_kinds": dict(Counter(r["bound_kind"] for r in rows)),
        "statuses": dict(Counter(r["status"] for r in rows)),
        "search_beat_strongest_share": float(np.mean([r["search_beat_strongest"] for r in rows])),
        "polished_steps": int(sum(r["polish_gain"] is not None for r in rows)),
        "polish_gain_mean": float(np.mean([r["polish_gain"] for r in rows if r["polish_gain"] is not None]
                                          or [1.0])),
        "strongest_names": dict(Counter(r["strongest"] for r in rows)),
        "latency_p50_s": _pct([r["latency_s"] for r in rows], 50),
        "latency_p95_s": _pct([r["latency_s"] for r in rows], 95),
        "cpu_p50_s": _pct([r["cpu_s"] for r in rows], 50),
        "cpu_p95_s": _pct([r["cpu_s"] for r in rows], 95),
    }
    # The bucket size fixed for the run: the one with the least total time over the cell's
    # steps (among those that held every step).
    totals = {b: sum(r["baselines_s"][b] for r in rows) for b in BUCKETS
              if all(b in r["baselines_s"] for r in rows)}
    summary["bucket_best_size"] = min(totals, key=lambda b: totals[b]) if totals else None
    for r in rows:
        if summary["bucket_best_size"] is not None:
            r["baselines_s"]["bucket-best"] = r["baselines_s"][summary["bucket_best_size"]]
    for name in BASELINES:
        ratios = [r["baselines_s"][name] / r["step_time_s"] for r in rows if name in r["baselines_s"]]
        summary[f"speedup_{name}_mean"] = float(np.mean(ratios)) if ratios else None
        summary[f"speedup_{name}_min"] = float(min(ratios)) if ratios else None
        # Throughput speedup over the whole run: total baseline time / total plan time.
        total = sum(r["step_time_s"] for r in rows if name in r["baselines_s"])
        summary[f"speedup_{name}_total"] = (
            sum(r["baselines_s"][name] for r in rows if name in r["baselines_s"]) / total
            if ratios else None)
    return {"summary": summary, "rows": rows}


def rss_probe(num_samples: int, cluster_name: str, workload: str) -> dict[str, Any]:
    """Peak RSS of a fresh process that imports the planner and plans one batch."""
    code = (
        "import resource, sys, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from costmodel.presets import default_cost_model_file, load_cluster\n"
        "from planner.planning import plan_batch\n"
        "from planner.config import PlannerConfig\n"
        "from planner.workload import WorkloadSpec, sample_batch\n"
        f"spec = WorkloadSpec.preset({workload!r}); cluster = load_cluster({cluster_name!r})\n"
        "cmf = default_cost_model_file(spec.model, cluster.hardware.name)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"samples = sample_batch(spec, num_samples={num_samples}, seed=0, step=0)\n"
        "t = time.perf_counter()\n"
        "plan = plan_batch(samples, cluster=cluster, cost_model=cmf,"
        " config=PlannerConfig.for_budget(1.0), reference_sample=spec.max_sample)\n"
        "t = time.perf_counter() - t\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(before, after, t, plan.solver.status)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    before_kb, after_kb, seconds, status = out.stdout.split()
    return {"workload": workload, "cluster": cluster_name, "num_samples": num_samples,
            "config": "for_budget(1.0)", "peak_rss_bytes": int(after_kb) * 1024,
            "rss_after_imports_bytes": int(before_kb) * 1024, "latency_s": float(seconds),
            "status": status}


SEARCH_STATUSES = ("HEURISTIC", "FEASIBLE", "OPTIMAL")


def by_workload(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, over its grid cells' steps: the steps by where the plan came from (the
    search's own HEURISTIC/FEASIBLE/OPTIMAL, a BASELINE as it is, a POLISHED_BASELINE), the share
    where the search alone beat the strongest baseline, and the gain of polishing (baseline's
    time / polished plan's time, over the polished steps)."""
    rows_of: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        rows_of.setdefault(cell["summary"]["workload"], []).extend(cell["rows"])
    out = []
    for workload, rows in rows_of.items():
        statuses = Counter(r["status"] for r in rows)
        gains = [r["polish_gain"] for r in rows if r["polish_gain"] is not None]
        out.append({
            "workload": workload, "steps": len(rows),
            "search_steps": sum(statuses[s] for s in SEARCH_STATUSES),
            "baseline_steps": statuses["BASELINE"], "polished_steps": statuses["POLISHED_BASELINE"],
            "statuses": dict(statuses),
            "search_beat_strongest_steps": int(sum(r["search_beat_strongest"] for r in rows)),
            "search_beat_strongest_share": float(np.mean([r["search_beat_strongest"] for r in rows])),
            "polish_gain_mean": float(np.mean(gains)) if gains else None,
            "polish_gain_max": float(max(gains)) if gains else None,
        })
    return out


def _print_by_workload(summaries: list[dict[str, Any]]) -> None:
    print(f"\n{'workload':17s}{'steps':>6s}{'search':>7s}{'BASE':>5s}{'POLISH':>7s}"
          f"{'search beat strongest':>23s}{'polish gain mean / max':>24s}")
    for s in summaries:
        gain = ("-" if s["polish_gain_mean"] is None else
                f"{(s['polish_gain_mean'] - 1) * 100:.2f}% / {(s['polish_gain_max'] - 1) * 100:.2f}%")
        print(f"{s['workload']:17s}{s['steps']:6d}{s['search_steps']:7d}{s['baseline_steps']:5d}"
              f"{s['polished_steps']:7d}{s['search_beat_strongest_share'] * 100:22.0f}%{gain:>24s}")


def _fmt(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


def _print_grid(cells: list[dict[str, Any]]) -> None:
    cols = [("xsp4", "bucket-sp4"), ("xbkbest", "bucket-best"), ("xstatic", "static-best"),
            ("xmegat", "megatron-dyncp"), ("xdcpgr", "dcp-greedy"), ("xnaive", "naive"),
            ("xstrong", "strongest")]
    head = (f"{'workload':17s}{'cluster':9s}{'batch':>6s} "
            + "".join(f"{c:>8s}" for c, _ in cols)
            + f"{'min':>6s}{'ceil':>6s}{'BASE':>5s} {'gap mean':>9s}{'gap p95':>8s}{'lp mean':>8s}"
            f"{'lp p95':>8s}{'cmp mean':>9s}{'cmp p95':>8s}{'cpu p50':>8s}{'cpu p95':>8s}")
    print(head)
    print("-" * len(head))
    for cell in cells:
        s = cell["summary"]
        base = s["statuses"].get("BASELINE", 0) + s["statuses"].get("POLISHED_BASELINE", 0)
        print(f"{s['workload']:17s}{s['cluster']:9s}{s['num_samples']:6d} "
              + "".join(f"{_fmt(s[f'speedup_{n}_mean']):>8s}" for _, n in cols)
              + f"{_fmt(s['speedup_strongest_min']):>6s}{_fmt(s['ceiling_strongest_mean']):>6s}"
              f"{base:5d} {s['gap_mean'] * 100:8.2f}%{s['gap_p95'] * 100:7.2f}%"
              f"{s['gap_lp_mean'] * 100:7.2f}%{s['gap_lp_p95'] * 100:7.2f}%"
              f"{s['gap_lp_compute_mean'] * 100:8.2f}%{s['gap_lp_compute_p95'] * 100:7.2f}%"
              f"{s['cpu_p50_s'] * 1e3:8.1f}{s['cpu_p95_s'] * 1e3:8.1f}")


def ablation(workloads: list[str], clusters: list[str], num_samples: int, steps: int,
             grid_rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """DCP-intra ablation: the default preset with inter-step search only (every sample at its
    cheapest policy alone, packed first-fit) against inter + intra (the grid's plans, or
    planned here when the grid did not run the cell)."""
    out = []
    for workload in workloads:
        for cluster_name in clusters:
            key = f"{workload}/{cluster_name}/{num_samples}"
            both = grid_rows.get(key) or run_cell(workload, cluster_name, num_samples, steps,
                                                  PlannerConfig(), lp_bound=False)["rows"]
            inter = run_cell(workload, cluster_name, num_samples, steps,
                             PlannerConfig(intra_policies=False), lp_bound=False)["rows"]
            gains = [a["step_time_s"] / b["step_time_s"] for a, b in zip(inter, both, strict=True)]
            out.append({"workload": workload, "cluster": cluster_name, "num_samples": num_samples,
                        "steps": len(gains), "intra_gain_mean": float(np.mean(gains)),
                        "intra_gain_max": float(max(gains)), "intra_gain_min": float(min(gains)),
                        "steps_faster": int(sum(g > 1 + 1e-9 for g in gains)),
                        "inter_only_x_strongest": float(np.mean(
                            [r["baselines_s"]["strongest"] / r["step_time_s"] for r in inter])),
                        "both_x_strongest": float(np.mean(
                            [r["baselines_s"]["strongest"] / r["step_time_s"] for r in both]))})
    return out


def main() -> None:
    if "--layouts" in sys.argv[1:]:  # the attention-layout comparison, with its own options
        from plan_quality_layouts import main as layouts_main

        layouts_main([a for a in sys.argv[1:] if a != "--layouts"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", action="store_true",
                        help="Instead of the grid: layouts chosen per group vs forced Ulysses vs forced ring "
                             "(bench/plan_quality_layouts.py, its options after this flag, "
                             "--out included).")
    parser.add_argument("--quick", action="store_true", help="3 steps, batches 64 and 256.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workloads", nargs="*", default=None,
                        help="Workload presets, or NAME@MODEL for a preset's samples under another model "
                             "(e.g. text-longtail@llama-3.1-8b); default: every preset but the "
                             "layout comparison's (LAYOUT_WORKLOADS).")
    parser.add_argument("--clusters", nargs="*", default=["h200x8", "h200x32", "h200x64"])
    parser.add_argument("--batches", nargs="*", type=int, default=[64, 256, 1024])
    parser.add_argument("--budgets", nargs="*", type=float, default=[0.05, 0.2, 1.0])
    parser.add_argument("--cpu", type=int, default=0, help="Pin to this core (-1: no pinning).")
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--ablation-batch", type=int, default=256,
                        help="Batch size of the DCP-intra ablation (0: skip it).")
    parser.add_argument("--expert-parallel", type=int, default=1,
                        help="Ranks a mixture-of-experts model's experts are split over (costed expert "
                             "parallelism, ClusterSpec.expert_parallel_size); dense models ignore it.")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="No progress bar or per-cell lines: the tables only.")
    args = parser.parse_args()
    pinned = _pin(None if args.cpu < 0 else args.cpu)
    workloads = args.workloads or [w for w in workload_names() if w not in LAYOUT_WORKLOADS]
    steps = 3 if args.quick else args.steps
    batches = [64, 256] if args.quick else args.batches
    out = args.out or default_out("plan_quality_quick" if args.quick else "plan_quality")
    result: dict[str, Any] = {
        **provenance(),  # command and commit (-dirty when tracked files differ)
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "pinned": pinned,
                    "loadavg_at_start": os.getloadavg()},
        "default_config": "PlannerConfig() (50 ms budget)",
        "batches": batches, "steps": steps, "clusters": args.clusters, "workloads": workloads,
        "expert_parallel_size": args.expert_parallel,
    }
    cells = []
    num_cells = 0 if args.skip_grid else len(workloads) * len(args.clusters) * len(batches)
    num_cells += len(args.budgets) * len(workloads)
    bar = make_progress(quiet=args.quiet, transient=True)
    task = bar.add_task(f"planning {num_cells} cells x {steps} steps", total=num_cells)
    bar.start()
    if not args.skip_grid:
        for workload in workloads:
            for cluster_name in args.clusters:
                for num_samples in batches:
                    cells.append(run_cell(workload, cluster_name, num_samples, steps,
                                          PlannerConfig(), expert_parallel_size=args.expert_parallel))
                    bar.advance(task)
                    s = cells[-1]["summary"]
                    if not args.quiet:
                        print(f"  {workload} {cluster_name} {num_samples}: gap {s['gap_mean']:.3%} "
                              f"x{_fmt(s['speedup_strongest_mean'])} (strongest) "
                              f"p50 {s['latency_p50_s'] * 1e3:.1f} ms", flush=True)
        print()
        _print_grid(cells)
        result["by_workload"] = by_workload(cells)
        _print_by_workload(result["by_workload"])
    result["grid"] = [c["summary"] for c in cells]
    result["grid_rows"] = {f"{c['summary']['workload']}/{c['summary']['cluster']}/"
                           f"{c['summary']['num_samples']}": c["rows"] for c in cells}
    budgets = []
    for budget in args.budgets:
        for workload in workloads:
            cell = run_cell(workload, "h200x32", 256, steps, PlannerConfig.for_budget(budget),
                            expert_parallel_size=args.expert_parallel)
            cell["summary"]["budget_s"] = budget
            budgets.append(cell["summary"])
            bar.advance(task)
    bar.stop()
    if budgets:
        print("\nquality by budget (256 samples, h200x32)")
        print(f"{'budget':>7s} {'workload':17s}{'gap mean':>9s}{'gap p95':>8s}{'lp mean':>8s}"
              f"{'lp p95':>8s}{'xstrong':>8s}"
              f"{'p50 ms':>8s}{'p95 ms':>8s}{'cpu p50':>8s}{'cpu p95':>8s}"
              f"{'cpsat+':>7s}{'gain':>7s}{'rounds':>9s}")
        for s in budgets:
            print(f"{s['budget_s']:7.2f} {s['workload']:17s}{s['gap_mean'] * 100:8.2f}%"
                  f"{s['gap_p95'] * 100:7.2f}%{s['gap_lp_mean'] * 100:7.2f}%"
                  f"{s['gap_lp_p95'] * 100:7.2f}%{_fmt(s['speedup_strongest_mean']):>8s}"
                  f"{s['latency_p50_s'] * 1e3:8.1f}{s['latency_p95_s'] * 1e3:8.1f}"
                  f"{s['cpu_p50_s'] * 1e3:8.1f}{s['cpu_p95_s'] * 1e3:8.1f}"
                  f"{s['cpsat_improved_share'] * 100:6.0f}%{(s['cpsat_gain_mean'] - 1) * 100:6.2f}%"
                  f"{s['lns_improved_rounds']:4d}/{s['lns_rounds']:<4d}")
    result["budgets"] = budgets
    if args.ablation_batch:
        abl = ablation(workloads, args.clusters, args.ablation_batch, steps, result["grid_rows"])
        print(f"\nDCP-intra ablation ({args.ablation_batch} samples, default preset): step time "
              "inter only / inter + intra")
        print(f"{'workload':17s}{'cluster':9s}{'mean':>8s}{'max':>8s}{'faster':>8s}"
              f"{'x strong inter':>16s}{'x strong both':>15s}")
        for a in abl:
            print(f"{a['workload']:17s}{a['cluster']:9s}{a['intra_gain_mean']:8.4f}"
                  f"{a['intra_gain_max']:8.4f}{a['steps_faster']:5d}/{a['steps']:<2d}"
                  f"{a['inter_only_x_strongest']:16.3f}{a['both_x_strongest']:15.3f}")
        result["ablation"] = abl
    rss = rss_probe(1024, "h200x64", "text-longtail")
    print(f"\npeak RSS, 1024 samples at 64 GPUs (text-longtail, fresh process): "
          f"{rss['peak_rss_bytes'] / 2**20:.0f} MiB (after imports "
          f"{rss['rss_after_imports_bytes'] / 2**20:.0f} MiB), {rss['latency_s']:.2f} s")
    result["rss"] = rss
    result["self_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
