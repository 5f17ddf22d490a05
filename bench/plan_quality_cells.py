"""One cell of ``bench/plan_quality.py``'s grid planned and summarised, and the views over cells
(statuses by workload, the DCP-intra ablation).

A step whose batch holds a sample that fits nowhere on the cluster (the planner's
``SampleFitsNowhereError``: even the largest allowed group with full checkpointing cannot hold
it) has no plan to measure: the cell records it under ``refused`` (``bench/refusals.py``) and
plans its other steps; its means are over the planned steps only, and a cell with none planned
carries no means at all. Any other error stops the run.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from refusals import refused  # noqa: E402  (bench/, the script's folder, is on sys.path)

from costmodel.presets import default_cost_model_file, load_cluster, load_model  # noqa: E402
from planner.baselines import strongest  # noqa: E402
from planner.bounds.lp import partition_lp_bound  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.planning import check_bound, plan_batch_with_stats, prepare  # noqa: E402
from planner.prepare import SampleFitsNowhereError  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

BUCKETS = ("bucket-sp1", "bucket-sp2", "bucket-sp4", "bucket-sp8")
BASELINES = (*BUCKETS, "bucket-best", "static-best", "megatron-dyncp", "dcp-greedy", "naive",
             "strongest")
"""Speedup columns: the registry's baselines, the best bucket size of the cell, the strongest."""

SEARCH_STATUSES = ("HEURISTIC", "FEASIBLE", "OPTIMAL")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _step_row(samples: list[Any], *, step: int, cluster: Any, cmf: Any, config: PlannerConfig,
              spec: WorkloadSpec, lp_bound: bool) -> dict[str, Any]:
    """One step planned and measured (raises ``SampleFitsNowhereError`` for a batch with no plan)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    plan, stats = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf, config=config, step=step,
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
    return {
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
    }


def _means(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's figures over the planned steps ``rows`` (at least one)."""
    return {
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


def _speedups(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The bucket size fixed for the run and the speedup over every baseline (sets each row's
    ``bucket-best``)."""
    # The bucket size fixed for the run: the one with the least total time over the cell's
    # steps (among those that held every step).
    totals = {b: sum(r["baselines_s"][b] for r in rows) for b in BUCKETS
              if all(b in r["baselines_s"] for r in rows)}
    out: dict[str, Any] = {"bucket_best_size": min(totals, key=lambda b: totals[b]) if totals else None}
    for r in rows:
        if out["bucket_best_size"] is not None:
            r["baselines_s"]["bucket-best"] = r["baselines_s"][out["bucket_best_size"]]
    for name in BASELINES:
        ratios = [r["baselines_s"][name] / r["step_time_s"] for r in rows if name in r["baselines_s"]]
        out[f"speedup_{name}_mean"] = float(np.mean(ratios)) if ratios else None
        out[f"speedup_{name}_min"] = float(min(ratios)) if ratios else None
        # Throughput speedup over the whole run: total baseline time / total plan time.
        total = sum(r["step_time_s"] for r in rows if name in r["baselines_s"])
        out[f"speedup_{name}_total"] = (
            sum(r["baselines_s"][name] for r in rows if name in r["baselines_s"]) / total
            if ratios else None)
    return out


def run_cell(workload: str, cluster_name: str, num_samples: int, steps: int,
             config: PlannerConfig, seed: int = 0, lp_bound: bool = True,
             expert_parallel_size: int = 1) -> dict[str, Any]:
    """Plan ``steps`` batches of one cell; summary and per-step rows. ``workload`` is a preset
    name, or ``NAME@MODEL`` for its samples under another model preset (``text-longtail@llama-3.1-8b``).
    ``expert_parallel_size`` splits a mixture-of-experts model's experts (dense models ignore it).

    A step the planner refuses with ``SampleFitsNowhereError`` has no row; the summary counts it
    under ``refused`` with the first such step's message, and ``planned_steps`` counts the rows.
    """
    name, _, model = workload.partition("@")
    spec = WorkloadSpec.preset(name)
    if model:
        spec = spec.model_copy(update={"model": model})
    experts = load_model(spec.model).num_experts
    cluster = load_cluster(cluster_name, **({"expert_parallel_size": expert_parallel_size}
                                            if experts and expert_parallel_size > 1 else {}))
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    rows = []
    refusals: list[str] = []
    for step in range(steps):
        samples = sample_batch(spec, num_samples=num_samples, seed=seed, step=step)
        try:
            rows.append(_step_row(samples, step=step, cluster=cluster, cmf=cmf, config=config, spec=spec,
                                  lp_bound=lp_bound))
        except SampleFitsNowhereError as exc:
            refusals.append(str(exc))
    summary: dict[str, Any] = {"workload": workload, "cluster": cluster_name, "num_samples": num_samples,
                               "steps": steps, "planned_steps": len(rows)}
    if refusals:
        summary["refused"] = refused(len(refusals), of=steps, reason=refusals[0])
    if rows:
        summary.update(_means(rows))
        summary.update(_speedups(rows))
    return {"summary": summary, "rows": rows}


def by_workload(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, over its grid cells' planned steps: the steps by where the plan came from
    (the search's own HEURISTIC/FEASIBLE/OPTIMAL, a BASELINE as it is, a POLISHED_BASELINE), the
    share where the search alone beat the strongest baseline, and the gain of polishing
    (baseline's time / polished plan's time, over the polished steps); the refused steps of its
    cells under ``refused`` (the first refused cell's reason)."""
    rows_of: dict[str, list[dict[str, Any]]] = {}
    refusals_of: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        workload = cell["summary"]["workload"]
        rows_of.setdefault(workload, []).extend(cell["rows"])
        refusals_of.setdefault(workload, [])
        if cell["summary"].get("refused"):
            refusals_of[workload].append(cell["summary"]["refused"])
    out = []
    for workload, rows in rows_of.items():
        statuses = Counter(r["status"] for r in rows)
        gains = [r["polish_gain"] for r in rows if r["polish_gain"] is not None]
        num_refused = sum(r["steps"] for r in refusals_of[workload])
        reason = refusals_of[workload][0]["reason"] if num_refused else None
        out.append({
            "workload": workload, "steps": len(rows),
            "search_steps": sum(statuses[s] for s in SEARCH_STATUSES),
            "baseline_steps": statuses["BASELINE"], "polished_steps": statuses["POLISHED_BASELINE"],
            "statuses": dict(statuses),
            "search_beat_strongest_steps": int(sum(r["search_beat_strongest"] for r in rows)),
            "search_beat_strongest_share": (float(np.mean([r["search_beat_strongest"] for r in rows]))
                                            if rows else None),
            "polish_gain_mean": float(np.mean(gains)) if gains else None,
            "polish_gain_max": float(max(gains)) if gains else None,
            **({"refused": refused(num_refused, of=num_refused + len(rows), reason=reason)} if num_refused else {}),
        })
    return out


def ablation(workloads: list[str], clusters: list[str], num_samples: int, steps: int,
             grid_cells: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """DCP-intra ablation: the default preset with inter-step search only (every sample at its
    cheapest policy alone, packed first-fit) against inter + intra (the grid's cells by
    ``workload/cluster/batch``, or planned here when the grid did not run the cell). Compared
    over the steps both planned; the others are counted under ``refused``."""
    out = []
    for workload in workloads:
        for cluster_name in clusters:
            key = f"{workload}/{cluster_name}/{num_samples}"
            both = grid_cells.get(key) or run_cell(workload, cluster_name, num_samples, steps,
                                                   PlannerConfig(), lp_bound=False)
            inter = run_cell(workload, cluster_name, num_samples, steps,
                             PlannerConfig(intra_policies=False), lp_bound=False)
            both_rows = {r["step"]: r for r in both["rows"]}
            pairs = [(a, both_rows[a["step"]]) for a in inter["rows"] if a["step"] in both_rows]
            reasons = [c["summary"]["refused"]["reason"] for c in (both, inter) if c["summary"].get("refused")]
            entry: dict[str, Any] = {"workload": workload, "cluster": cluster_name, "num_samples": num_samples,
                                     "steps": len(pairs)}
            if len(pairs) < steps:
                entry["refused"] = refused(steps - len(pairs), of=steps, reason=reasons[0] if reasons else None)
            if pairs:
                gains = [a["step_time_s"] / b["step_time_s"] for a, b in pairs]
                entry.update({
                    "intra_gain_mean": float(np.mean(gains)), "intra_gain_max": float(max(gains)),
                    "intra_gain_min": float(min(gains)), "steps_faster": int(sum(g > 1 + 1e-9 for g in gains)),
                    "inter_only_x_strongest": float(np.mean(
                        [a["baselines_s"]["strongest"] / a["step_time_s"] for a, _ in pairs])),
                    "both_x_strongest": float(np.mean(
                        [b["baselines_s"]["strongest"] / b["step_time_s"] for _, b in pairs]))})
            out.append(entry)
    return out
