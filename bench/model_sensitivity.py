"""How much the cost model matters: the step-time loss from each kind of model error (issue 9, item 6).

For each workload x cluster, ``--steps`` seeded batches of ``--num-samples`` samples are planned
under the analytic cost model ``M`` (the planner's belief). Then, for each term of the model
and each sign, ``M'`` is ``M`` with that one term made ``--error`` (default 30%) more or less
costly, and ``M'`` is taken as the truth:

* ``P``  = plan made under ``M``  (the planner was wrong about the term),
* ``P'`` = plan made under ``M'`` (the planner knew the truth),

both scored under ``M'`` by :func:`score_plan`, which recomputes every micro-batch's time and
peak memory from the cost model (never the plan's stored predictions). The loss of a step is
``T_M'(P) / T_M'(P') - 1``. A plan made under ``M`` may break the memory cap under ``M'``
(memory perturbed up): such steps are counted as infeasible and left out of the loss
statistics (their time-only loss is kept in the JSON).

The planner is a heuristic, so part of a loss can be search noise: ``P'`` may also be better
than ``P`` under ``M`` itself (and fit under it), i.e. the planner under ``M`` missed it for
reasons unrelated to the model error. Such steps are counted (``P' better under M too``), as
are steps with a negative loss (``P'`` worse than ``P`` under the truth it was planned for).

Terms (``+`` = the term costs ``1 + error`` times as much, ``-`` = ``1 - error`` times):

* ``compute``: every per-token and pair coefficient of forward and backward (``per_token``,
  ``per_attn_pair``, ``per_spatial_pair``, ``per_temporal_pair``) and the head's per-token cost;
* ``knee``: the efficiency curve's half-performance lengths (``attention_half_tokens``,
  ``linear_half_tokens``): ``+`` moves the knee out, short calls run further below peak;
* ``alltoall``: every all-to-all ``LinkFit`` (``alpha_s`` times the factor, ``bytes_per_s``
  divided by it); the gradient all-reduce is left alone (it is the same for every plan);
* ``alltoall-inter``: the same on the inter-node all-to-all links only (node-crossing groups,
  the kind of error issue 9 found in ``dcp fit``);
* ``overheads``: the fixed costs, ``per_call`` and ``per_sample`` of forward and backward and
  ``microbatch_overhead_s``;
* ``memory``: activation bytes per token (``none``, ``full``, ``working``, ``transient``); model
  states and ``fixed_working_bytes`` are left alone.

Run from the repository root::

    .venv/bin/python bench/model_sensitivity.py        # 5 workloads x h200x32, h200x64, 10 steps: ~3 min
    .venv/bin/python bench/model_sensitivity.py --workloads video-short text-longtail --steps 3

It prints Markdown tables (per cell and term, mean loss per cell x term, then per term over
all cells) and writes ``--out`` (default ``bench-out/model_sensitivity.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from costmodel.evaluate import CostModel, nodes_spanned  # noqa: E402
from costmodel.presets import default_cost_model_file, load_cluster, workload_names  # noqa: E402
from costmodel.schema import CostModelFile  # noqa: E402
from costmodel.specs import ClusterSpec, Sample  # noqa: E402
from dcp_cli.progress import progress_bar  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.planning import plan_batch  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

TERMS = ("compute", "knee", "alltoall", "alltoall-inter", "overheads", "memory")
"""The cost-model terms perturbed, one at a time (see the module docstring)."""

_CAP_REL_TOL = 1e-12
"""Relative slack over the memory cap before a micro-batch counts as over it (as ``validate_plan``)."""

_PASS_WORK_FIELDS = ("per_token", "per_attn_pair", "per_spatial_pair", "per_temporal_pair")
_PASS_FIXED_FIELDS = ("per_call", "per_sample")
_ACTIVATION_FIELDS = ("bytes_per_token_layer_none", "bytes_per_token_layer_full",
                      "working_bytes_per_token", "transient_bytes_per_token")


def perturb(file: CostModelFile, *, term: str, factor: float) -> CostModelFile:
    """``file`` with one term's cost multiplied by ``factor`` (validated, with a new id).

    Args:
        file: The cost model to perturb.
        term: One of :data:`TERMS`.
        factor: Multiplier of the term's cost (1.3 = 30% more costly; for a bandwidth, the
            bandwidth is divided by it).

    Returns:
        A new file whose id is ``<id>:<term>-x<factor>``.

    Raises:
        ValueError: for an unknown term or a non-positive factor.
    """
    if term not in TERMS:
        raise ValueError(f"term {term!r} is not one of {list(TERMS)}")
    if not factor > 0:
        raise ValueError(f"factor must be positive, got {factor}")
    data = file.model_dump(mode="python")
    compute, activation, comm = data["compute"], data["activation"], data["comm"]
    if term == "compute":
        for pass_name in ("forward", "backward"):
            for name in _PASS_WORK_FIELDS:
                compute[pass_name][name] *= factor
        compute["head_s_per_token"] *= factor
    elif term == "knee":
        compute["attention_half_tokens"] *= factor
        compute["linear_half_tokens"] *= factor
    elif term in ("alltoall", "alltoall-inter"):
        for link in comm["alltoall"]:
            if term == "alltoall" or link["placement"] == "inter":
                link["alpha_s"] *= factor
                link["bytes_per_s"] /= factor
    elif term == "overheads":
        for pass_name in ("forward", "backward"):
            for name in _PASS_FIXED_FIELDS:
                compute[pass_name][name] *= factor
        compute["microbatch_overhead_s"] *= factor
    else:  # memory
        for name in _ACTIVATION_FIELDS:
            activation[name] *= factor
    data["id"] = f"{file.id}:{term}-x{factor:.4g}"
    return CostModelFile.model_validate(data)


@dataclass(frozen=True, slots=True)
class PlanScore:
    """A plan's time and memory recomputed under a cost model."""

    step_time_s: float
    """Slowest group's summed micro-batch times plus the gradient sync."""
    compute_makespan_s: float
    """Slowest group's summed micro-batch times."""
    grad_sync_time_s: float
    """Gradient sync of the step."""
    peak_mem_bytes: float
    """Highest per-rank peak of any micro-batch."""
    num_microbatches: int
    """Micro-batches in the plan."""
    num_microbatches_over_cap: int
    """Micro-batches whose per-rank peak is over the memory cap."""

    @property
    def feasible(self) -> bool:
        """True when every micro-batch fits under the memory cap."""
        return self.num_microbatches_over_cap == 0


def score_plan(plan: Plan, cost_model: CostModel) -> PlanScore:
    """Time and peak memory of a plan under ``cost_model``, from its groups, micro-batches and
    policies alone (the plan's stored predictions are not read).

    Each micro-batch is timed by ``CostModel.microbatch_time_s`` with the nodes its group's
    contiguous ranks span; a group's time is the sum of its micro-batches; the step is the
    slowest group plus ``grad_sync_time_s()``.

    Args:
        plan: The plan to score.
        cost_model: The cost model taken as the truth, bound to the plan's cluster.

    Raises:
        ValueError: when the plan is for another world size than the cost model's cluster.
    """
    cluster = cost_model.cluster
    if plan.num_ranks != cluster.num_gpus:
        raise ValueError(f"plan is for {plan.num_ranks} ranks, cluster {cluster.name!r} has "
                         f"{cluster.num_gpus}")
    cap_bytes = cluster.memory_cap_bytes
    makespan_s = 0.0
    peak_bytes = cost_model.fixed_bytes()
    num_microbatches = 0
    num_over_cap = 0
    for group in plan.groups:
        num_nodes = nodes_spanned(first_rank=group.first_rank, group_size=group.size,
                                  gpus_per_node=cluster.gpus_per_node)
        layout = None if group.ring_degree == 1 else cost_model.place(  # a Ulysses x ring group
            first_rank=group.first_rank, group_size=group.size, ring_degree=group.ring_degree)
        group_time_s = 0.0
        for mb in group.micro_batches:
            samples = [ps.sample for ps in mb.samples]
            policies = [ps.recompute_layers for ps in mb.samples]
            group_time_s += cost_model.microbatch_time_s(samples, group_size=group.size,
                                                         recompute_layers=policies,
                                                         num_nodes=num_nodes, layout=layout)
            mb_peak_bytes = cost_model.microbatch_peak_bytes(samples, group_size=group.size,
                                                             recompute_layers=policies, layout=layout)
            peak_bytes = max(peak_bytes, mb_peak_bytes)
            num_microbatches += 1
            num_over_cap += int(mb_peak_bytes > cap_bytes * (1 + _CAP_REL_TOL))
        makespan_s = max(makespan_s, group_time_s)
    sync_s = cost_model.grad_sync_time_s()
    return PlanScore(step_time_s=makespan_s + sync_s, compute_makespan_s=makespan_s,
                     grad_sync_time_s=sync_s, peak_mem_bytes=peak_bytes,
                     num_microbatches=num_microbatches, num_microbatches_over_cap=num_over_cap)


def plan_layout(plan: Plan) -> tuple[tuple[int, tuple[tuple[tuple[str, int], ...], ...]], ...]:
    """What a plan executes (groups, micro-batches, sample ids and policies), for equality."""
    return tuple((g.first_rank, tuple(tuple((ps.sample.id, ps.recompute_layers) for ps in mb.samples)
                                      for mb in g.micro_batches)) for g in plan.groups)


@dataclass(frozen=True, slots=True)
class StepSensitivity:
    """One step under one perturbed model ``M'``: the plan made under ``M`` against re-planning."""

    believed_s: float
    """``T_M(P)``: the step time the planner predicted for its plan."""
    true_s: float
    """``T_M'(P)``: the plan made under ``M``, scored under ``M'``."""
    replanned_s: float | None
    """``T_M'(P')``: the plan made under ``M'``, scored under ``M'`` (None: ``M'`` cannot plan)."""
    loss: float | None
    """``T_M'(P) / T_M'(P') - 1`` (None when ``P'`` is missing)."""
    feasible: bool
    """Whether ``P`` stays under the memory cap under ``M'``."""
    num_microbatches_over_cap: int
    """Micro-batches of ``P`` over the cap under ``M'``."""
    num_microbatches: int
    """Micro-batches of ``P``."""
    peak_over_cap: float
    """``P``'s highest per-rank peak under ``M'`` over the memory cap (above 1: infeasible)."""
    replanned_gap: float | None
    """``P'``'s own gap to its lower bound under ``M'`` (the planner's search slack)."""
    replanned_believed_s: float | None
    """``T_M(P')``: the re-plan scored under the believed model. Below ``believed_s`` (and
    ``replanned_fits_believed``), the planner under ``M`` missed a plan better under ``M``
    itself: search noise, not model error."""
    replanned_fits_believed: bool | None
    """Whether ``P'`` stays under the memory cap under ``M``."""
    replan_changed: bool
    """Whether ``P'`` executes anything differently from ``P``."""
    group_sizes: list[int]
    """``P``'s group sizes, largest first."""
    replanned_group_sizes: list[int] | None
    """``P'``'s group sizes, largest first."""
    replan_error: str | None = None
    """Why ``M'`` could not plan the batch (e.g. a sample that fits nowhere)."""


def step_sensitivity(samples: Sequence[Sample], *, cluster: ClusterSpec, believed: CostModelFile,
                     truth: CostModelFile, config: PlannerConfig, plan: Plan | None = None,
                     step: int | None = None, reference_sample: Sample | None = None
                     ) -> StepSensitivity:
    """Plan one batch under ``believed`` and under ``truth``; score both plans under ``truth``.

    Args:
        samples: The batch.
        cluster: The world.
        believed: The model the planner uses (``M``).
        truth: The model taken as the truth (``M'``).
        config: Planner settings for both plans.
        plan: ``P`` when already made under ``believed`` (it is planned otherwise).
        step: Step index passed to the planner.
        reference_sample: The workload's longest sample (bucket baselines' SP size).
    """
    if plan is None:
        plan = plan_batch(samples, cluster=cluster, cost_model=believed, config=config, step=step,
                          reference_sample=reference_sample)
    truth_cm = CostModel(file=truth, cluster=cluster)
    score = score_plan(plan, truth_cm)
    sizes = sorted((g.size for g in plan.groups), reverse=True)
    unplanned = StepSensitivity(
        believed_s=plan.predicted_step_time_s, true_s=score.step_time_s, replanned_s=None,
        loss=None, feasible=score.feasible, num_microbatches_over_cap=score.num_microbatches_over_cap,
        num_microbatches=score.num_microbatches,
        peak_over_cap=score.peak_mem_bytes / cluster.memory_cap_bytes, replanned_gap=None,
        replanned_believed_s=None, replanned_fits_believed=None,
        replan_changed=True, group_sizes=sizes, replanned_group_sizes=None)
    try:
        replanned = plan_batch(samples, cluster=cluster, cost_model=truth, config=config, step=step,
                               reference_sample=reference_sample)
    except ValueError as exc:
        return replace(unplanned, replan_error=str(exc))
    replanned_s = score_plan(replanned, truth_cm).step_time_s
    under_believed = score_plan(replanned, CostModel(file=believed, cluster=cluster))
    return replace(unplanned, replanned_s=replanned_s, loss=score.step_time_s / replanned_s - 1.0,
                   replanned_gap=replanned.gap,
                   replanned_believed_s=under_believed.step_time_s,
                   replanned_fits_believed=under_believed.feasible,
                   replan_changed=plan_layout(plan) != plan_layout(replanned),
                   replanned_group_sizes=sorted((g.size for g in replanned.groups), reverse=True))


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p95": None, "max": None, "min": None}
    return {"mean": float(np.mean(values)), "p95": float(np.percentile(values, 95)),
            "max": float(max(values)), "min": float(min(values))}


def summarize(rows: list[StepSensitivity]) -> dict[str, Any]:
    """Loss statistics of one (cell, term, sign) over its steps.

    ``loss`` covers the steps whose ``P`` is feasible under ``M'`` and whose ``P'`` exists;
    ``loss_time_only`` ignores feasibility; ``prediction_error`` is ``T_M(P)/T_M'(P) - 1``;
    ``replanned_gap`` is ``P'``'s gap to its own lower bound, the scale of the search's slack
    (a loss below it is within what the planner leaves on the table anyway).
    """
    feasible = [r.loss for r in rows if r.feasible and r.loss is not None]
    return {
        "num_steps": len(rows),
        "num_infeasible": sum(not r.feasible for r in rows),
        "num_microbatches_over_cap": sum(r.num_microbatches_over_cap for r in rows),
        "num_microbatches": sum(r.num_microbatches for r in rows),
        "peak_over_cap_max": float(max(r.peak_over_cap for r in rows)),
        "num_replan_failed": sum(r.replanned_s is None for r in rows),
        "num_replan_changed": sum(r.replan_changed for r in rows),
        "num_negative_loss": sum(x < -1e-12 for x in feasible),
        "num_replan_better_under_believed": sum(
            bool(r.replanned_fits_believed) and r.replanned_believed_s is not None
            and r.replanned_believed_s < r.believed_s * (1 - 1e-9) for r in rows),
        "loss": _stats(feasible),
        "loss_time_only": _stats([r.loss for r in rows if r.loss is not None]),
        "prediction_error_mean": float(np.mean([r.believed_s / r.true_s - 1 for r in rows])),
        "replanned_gap_mean": (float(np.mean(gaps)) if (gaps := [r.replanned_gap for r in rows
                                                                if r.replanned_gap is not None])
                               else None),
    }


def _step_json(row: StepSensitivity) -> dict[str, Any]:
    """A step's row for the JSON, group sizes as ``{size: count}``."""
    data = asdict(row)
    for key in ("group_sizes", "replanned_group_sizes"):
        if data[key] is not None:
            data[key] = {str(size): data[key].count(size) for size in sorted(set(data[key]), reverse=True)}
    return data


def run_cell(workload: str, cluster_name: str, *, num_samples: int, steps: int, error: float,
             config: PlannerConfig, seed: int = 0) -> dict[str, Any]:
    """Every term and sign for one workload on one cluster."""
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    believed = default_cost_model_file(spec.model, cluster.hardware.name)
    variants = [(term, sign) for term in TERMS for sign in (+1, -1)]
    truths = {(t, s): perturb(believed, term=t, factor=1.0 + s * error) for t, s in variants}
    rows: dict[tuple[str, int], list[StepSensitivity]] = {v: [] for v in variants}
    start = time.perf_counter()
    for step in range(steps):
        samples = sample_batch(spec, num_samples=num_samples, seed=seed, step=step)
        plan = plan_batch(samples, cluster=cluster, cost_model=believed, config=config, step=step,
                          reference_sample=spec.max_sample)
        for v in variants:
            rows[v].append(step_sensitivity(samples, cluster=cluster, believed=believed,
                                            truth=truths[v], config=config, plan=plan, step=step,
                                            reference_sample=spec.max_sample))
    elapsed_s = time.perf_counter() - start
    results = []
    for (term, sign), term_rows in rows.items():
        results.append({"workload": workload, "cluster": cluster_name, "term": term,
                        "factor": 1.0 + sign * error, **summarize(term_rows),
                        "steps": [_step_json(r) for r in term_rows]})
    return {"workload": workload, "cluster": cluster_name, "elapsed_s": elapsed_s, "results": results}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}%"


def _sign(factor: float) -> str:
    return f"{(factor - 1) * 100:+.0f}%"


def _infeasible(r: dict[str, Any]) -> str:
    text = f"{r['num_infeasible']}/{r['num_steps']}"
    if r["num_infeasible"]:
        text += (f" ({r['num_microbatches_over_cap']}/{r['num_microbatches']}, "
                 f"{r['peak_over_cap_max']:.2f})")
    if r.get("num_replan_failed"):
        text += f"; re-plan failed {r['num_replan_failed']}"
    return text


def markdown_cells(results: list[dict[str, Any]]) -> str:
    """Per (workload, cluster, term, sign): loss mean / p95 / max / min, infeasible and changed steps."""
    lines = ["| workload | cluster | term | error | loss mean | loss p95 | loss max | loss min "
             "| P infeasible (mb over cap, worst peak/cap) | re-plan changed | P' gap | predicted vs true |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        loss = r["loss"]
        lines.append(
            f"| {r['workload']} | {r['cluster']} | {r['term']} | {_sign(r['factor'])} "
            f"| {_pct(loss['mean'])} | {_pct(loss['p95'])} | {_pct(loss['max'])} | {_pct(loss['min'])} "
            f"| {_infeasible(r)} | {r['num_replan_changed']}/{r['num_steps']} "
            f"| {_pct(r['replanned_gap_mean'])} | {_pct(r['prediction_error_mean'])} |")
    return "\n".join(lines)


def markdown_matrix(results: list[dict[str, Any]]) -> str:
    """Mean loss per (workload, cluster) x (term, sign); ``N/M OOM`` where ``P`` breaks the cap
    on N of M steps (the loss is then over the other steps, ``-`` if none)."""
    variants = sorted({(r["term"], r["factor"]) for r in results},
                      key=lambda v: (TERMS.index(v[0]), -v[1]))
    cells = list(dict.fromkeys((r["workload"], r["cluster"]) for r in results))
    index = {(r["workload"], r["cluster"], r["term"], r["factor"]): r for r in results}
    lines = ["| workload | cluster | " + " | ".join(f"{t} {_sign(f)}" for t, f in variants) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in variants) + " |"]
    for workload, cluster in cells:
        entries = []
        for term, factor in variants:
            r = index[(workload, cluster, term, factor)]
            text = _pct(r["loss"]["mean"])
            if r["num_infeasible"]:
                text += f" ({r['num_infeasible']}/{r['num_steps']} OOM)"
            entries.append(text)
        lines.append(f"| {workload} | {cluster} | " + " | ".join(entries) + " |")
    return "\n".join(lines)


def by_term(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (term, sign) over all cells: step-weighted loss mean, worst p95 and max, counts."""
    out = []
    for term in TERMS:
        for factor in sorted({r["factor"] for r in results if r["term"] == term}, reverse=True):
            cells = [r for r in results if r["term"] == term and r["factor"] == factor]
            losses = [s["loss"] for c in cells for s in c["steps"]
                      if s["feasible"] and s["loss"] is not None]
            out.append({
                "term": term, "factor": factor, "num_steps": sum(c["num_steps"] for c in cells),
                "num_infeasible": sum(c["num_infeasible"] for c in cells),
                "num_microbatches_over_cap": sum(c["num_microbatches_over_cap"] for c in cells),
                "num_microbatches": sum(c["num_microbatches"] for c in cells),
                "peak_over_cap_max": max(c["peak_over_cap_max"] for c in cells),
                "loss_time_only": _stats([s["loss"] for c in cells for s in c["steps"]
                                          if s["loss"] is not None]),
                "num_replan_failed": sum(c["num_replan_failed"] for c in cells),
                "num_replan_changed": sum(c["num_replan_changed"] for c in cells),
                "num_replan_better_under_believed": sum(c["num_replan_better_under_believed"]
                                                        for c in cells),
                "num_negative_loss": sum(c["num_negative_loss"] for c in cells),
                "loss": _stats(losses),
                "worst_cell_mean": max((c["loss"]["mean"] for c in cells if c["loss"]["mean"] is not None),
                                       default=None),
                "worst_cell": max(((c["loss"]["mean"], f"{c['workload']}/{c['cluster']}") for c in cells
                                   if c["loss"]["mean"] is not None), default=(None, None))[1],
            })
    return out


def markdown_terms(summary: list[dict[str, Any]]) -> str:
    """The per-term summary as a Markdown table."""
    lines = ["| term | error | loss mean | loss p95 | loss max | worst cell (its mean) "
             "| P infeasible (mb over cap, worst peak/cap) | re-plan changed | P' better under M too "
             "| loss < 0 |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in summary:
        loss = r["loss"]
        worst = "-" if r["worst_cell"] is None else f"{r['worst_cell']} ({_pct(r['worst_cell_mean'])})"
        lines.append(f"| {r['term']} | {_sign(r['factor'])} | {_pct(loss['mean'])} | {_pct(loss['p95'])} "
                     f"| {_pct(loss['max'])} | {worst} | {_infeasible(r)} "
                     f"| {r['num_replan_changed']}/{r['num_steps']} "
                     f"| {r['num_replan_better_under_believed']}/{r['num_steps']} "
                     f"| {r['num_negative_loss']}/{r['num_steps']} |")
    return "\n".join(lines)


def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="*", default=None, help="Default: all presets.")
    parser.add_argument("--clusters", nargs="*", default=["h200x32", "h200x64"])
    parser.add_argument("--steps", type=int, default=10, help="Batches per workload x cluster.")
    parser.add_argument("--num-samples", type=int, default=256, help="Samples per batch.")
    parser.add_argument("--error", type=float, default=0.3, help="Relative error of the term (0.3 = +-30%%).")
    parser.add_argument("--budget-s", type=float, default=0.2,
                        help="Planner preset: PlannerConfig.for_budget(BUDGET_S).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=default_out("model_sensitivity"))
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="No progress bar or per-cell lines: the tables only.")
    args = parser.parse_args()
    if not 0 < args.error < 1:
        parser.error(f"--error must be in (0, 1), got {args.error}")
    if args.steps < 1 or args.num_samples < 1:
        parser.error("--steps and --num-samples must be positive")
    workloads = args.workloads or workload_names()
    config = PlannerConfig.for_budget(args.budget_s)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           text=True, capture_output=True, check=False).stdout.strip()
    loadavg_start = os.getloadavg()
    start = time.perf_counter()
    cells = []
    num_cells = len(workloads) * len(args.clusters)
    with progress_bar(f"{num_cells} cells x {args.steps} steps", quiet=args.quiet, total=num_cells) as update:
        for workload in workloads:
            for cluster_name in args.clusters:
                cell = run_cell(workload, cluster_name, num_samples=args.num_samples, steps=args.steps,
                                error=args.error, config=config, seed=args.seed)
                cells.append(cell)
                update(len(cells), num_cells)
                worst = max(cell["results"], key=lambda r: r["loss"]["mean"] or -1.0)
                if not args.quiet:
                    print(f"  {workload} {cluster_name}: {cell['elapsed_s']:.1f} s; worst mean loss "
                          f"{_pct(worst['loss']['mean'])} ({worst['term']} {_sign(worst['factor'])})",
                          file=sys.stderr, flush=True)
    results = [r for c in cells for r in c["results"]]
    summary = by_term(results)
    print(markdown_cells(results))
    print()
    print(markdown_matrix(results))
    print()
    print(markdown_terms(summary))
    out: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": (commit + ("+dirty" if dirty else "")) or None,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "loadavg_at_start": loadavg_start,
                    "loadavg_at_end": os.getloadavg()},
        "elapsed_s": time.perf_counter() - start,
        "planner": {"preset": f"PlannerConfig.for_budget({args.budget_s})", **asdict(config)},
        "num_samples": args.num_samples, "steps": args.steps, "seed": args.seed, "error": args.error,
        "believed_model": "analytic default (costmodel.presets.default_cost_model_file)",
        "by_term": summary,
        "cells": [{k: v for k, v in c.items() if k != "results"} for c in cells],
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out} in {out['elapsed_s']:.0f} s (load average at start "
          f"{loadavg_start[0]:.2f}, at end {out['machine']['loadavg_at_end'][0]:.2f})", file=sys.stderr)


if __name__ == "__main__":
    main()
