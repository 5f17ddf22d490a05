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

A step whose batch holds a sample that fits nowhere on the cluster is counted as refused, with
the planner's message, and the cell's figures are over its other steps (``bench/refusals.py``);
a cell with every step refused says so in place of figures.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plan_quality_cells import ablation, by_workload, run_cell  # noqa: E402  (bench/, the script's folder)
from provenance import default_out, provenance  # noqa: E402  (bench/, the script's folder, is on sys.path)
from refusals import fully_refused, refusal_note  # noqa: E402  (bench/, the script's folder)

from costmodel.presets import workload_names  # noqa: E402
from dcp_cli.progress import make_progress  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402

LAYOUT_WORKLOADS = ("text-millionctx", "video3d-longclip")
"""Presets of the attention-layout comparison (``--layouts``, bench/plan_quality_layouts.py),
left out of the default grid: their longest samples need groups past the heads (ring layouts),
which the grid's Ulysses-era plans and baselines cannot hold on 8 GPUs."""


def _pin(cpu: int | None) -> str:
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return "unpinned"
    os.sched_setaffinity(0, {cpu})
    return f"cpu {cpu}"


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


def _line(head: str, item: dict[str, Any], figures: Callable[[dict[str, Any]], str]) -> str:
    """A printed row: ``head``, then the item's figures and any refused steps, or for an item
    with no planned step the refusal alone."""
    if fully_refused(item):
        return f"{head}{refusal_note(item)}"
    note = refusal_note(item)
    return head + figures(item) + (f"  {note}" if note else "")


def _print_by_workload(summaries: list[dict[str, Any]]) -> None:
    print(f"\n{'workload':17s}{'steps':>6s}{'search':>7s}{'BASE':>5s}{'POLISH':>7s}"
          f"{'search beat strongest':>23s}{'polish gain mean / max':>24s}")
    for s in summaries:
        print(_line(f"{s['workload']:17s}", s, _by_workload_figures))


def _by_workload_figures(s: dict[str, Any]) -> str:
    gain = ("-" if s["polish_gain_mean"] is None else
            f"{(s['polish_gain_mean'] - 1) * 100:.2f}% / {(s['polish_gain_max'] - 1) * 100:.2f}%")
    return (f"{s['steps']:6d}{s['search_steps']:7d}{s['baseline_steps']:5d}"
            f"{s['polished_steps']:7d}{s['search_beat_strongest_share'] * 100:22.0f}%{gain:>24s}")


def _fmt(v: float | None) -> str:
    return f"{v:.2f}" if v is not None else "-"


GRID_COLUMNS = [("xsp4", "bucket-sp4"), ("xbkbest", "bucket-best"), ("xstatic", "static-best"),
                ("xmegat", "megatron-dyncp"), ("xdcpgr", "dcp-greedy"), ("xnaive", "naive"),
                ("xstrong", "strongest")]
"""The printed grid's speedup columns: heading, baseline."""


def _grid_figures(s: dict[str, Any]) -> str:
    return ("".join(f"{_fmt(s[f'speedup_{n}_mean']):>8s}" for _, n in GRID_COLUMNS)
            + f"{_fmt(s['speedup_strongest_min']):>6s}{_fmt(s['ceiling_strongest_mean']):>6s}"
            f"{s['statuses'].get('BASELINE', 0) + s['statuses'].get('POLISHED_BASELINE', 0):5d} "
            f"{s['gap_mean'] * 100:8.2f}%{s['gap_p95'] * 100:7.2f}%"
            f"{s['gap_lp_mean'] * 100:7.2f}%{s['gap_lp_p95'] * 100:7.2f}%"
            f"{s['gap_lp_compute_mean'] * 100:8.2f}%{s['gap_lp_compute_p95'] * 100:7.2f}%"
            f"{s['cpu_p50_s'] * 1e3:8.1f}{s['cpu_p95_s'] * 1e3:8.1f}")


def _print_grid(cells: list[dict[str, Any]]) -> None:
    head = (f"{'workload':17s}{'cluster':9s}{'batch':>6s} "
            + "".join(f"{c:>8s}" for c, _ in GRID_COLUMNS)
            + f"{'min':>6s}{'ceil':>6s}{'BASE':>5s} {'gap mean':>9s}{'gap p95':>8s}{'lp mean':>8s}"
            f"{'lp p95':>8s}{'cmp mean':>9s}{'cmp p95':>8s}{'cpu p50':>8s}{'cpu p95':>8s}")
    print(head)
    print("-" * len(head))
    for cell in cells:
        s = cell["summary"]
        print(_line(f"{s['workload']:17s}{s['cluster']:9s}{s['num_samples']:6d} ", s, _grid_figures))


def _budget_figures(s: dict[str, Any]) -> str:
    return (f"{s['gap_mean'] * 100:8.2f}%"
            f"{s['gap_p95'] * 100:7.2f}%{s['gap_lp_mean'] * 100:7.2f}%"
            f"{s['gap_lp_p95'] * 100:7.2f}%{_fmt(s['speedup_strongest_mean']):>8s}"
            f"{s['latency_p50_s'] * 1e3:8.1f}{s['latency_p95_s'] * 1e3:8.1f}"
            f"{s['cpu_p50_s'] * 1e3:8.1f}{s['cpu_p95_s'] * 1e3:8.1f}"
            f"{s['cpsat_improved_share'] * 100:6.0f}%{(s['cpsat_gain_mean'] - 1) * 100:6.2f}%"
            f"{s['lns_improved_rounds']:4d}/{s['lns_rounds']:<4d}")


def _ablation_figures(a: dict[str, Any]) -> str:
    return (f"{a['intra_gain_mean']:8.4f}{a['intra_gain_max']:8.4f}{a['steps_faster']:5d}/{a['steps']:<2d}"
            f"{a['inter_only_x_strongest']:16.3f}{a['both_x_strongest']:15.3f}")


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
                        print(_line(f"  {workload} {cluster_name} {num_samples}: ", s, lambda s: (
                            f"gap {s['gap_mean']:.3%} x{_fmt(s['speedup_strongest_mean'])} (strongest) "
                            f"p50 {s['latency_p50_s'] * 1e3:.1f} ms")), flush=True)
        print()
        _print_grid(cells)
        result["by_workload"] = by_workload(cells)
        _print_by_workload(result["by_workload"])
    result["grid"] = [c["summary"] for c in cells]
    grid_cells = {f"{c['summary']['workload']}/{c['summary']['cluster']}/{c['summary']['num_samples']}": c
                  for c in cells}
    result["grid_rows"] = {key: c["rows"] for key, c in grid_cells.items()}
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
            print(_line(f"{s['budget_s']:7.2f} {s['workload']:17s}", s, _budget_figures))
    result["budgets"] = budgets
    if args.ablation_batch:
        abl = ablation(workloads, args.clusters, args.ablation_batch, steps, grid_cells)
        print(f"\nDCP-intra ablation ({args.ablation_batch} samples, default preset): step time "
              "inter only / inter + intra")
        print(f"{'workload':17s}{'cluster':9s}{'mean':>8s}{'max':>8s}{'faster':>8s}"
              f"{'x strong inter':>16s}{'x strong both':>15s}")
        for a in abl:
            print(_line(f"{a['workload']:17s}{a['cluster']:9s}", a, _ablation_figures))
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
