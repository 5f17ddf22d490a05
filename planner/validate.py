"""Validator and simulator of plans: the one place that says whether a plan is correct.

``validate_plan`` recomputes everything from the cost model and lists every broken invariant:
each sample of the batch exactly once (same id, same shape), groups partition the ranks,
allowed and topology-aware group sizes and placement, policies in range, every micro-batch
under the memory cap, and every predicted number equal to the cost model's. ``simulate``
replays the plan on the cost model: per-group timelines, idle fraction, step time and peak
memory per rank. The service and the tests use these same functions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.evaluate import CostModel, GroupLayout, nodes_spanned
from costmodel.specs import Sample
from costmodel.units import fmt_bytes
from planner.bounds.check import bound_problem, plan_witnesses_tie
from planner.plan import GroupPlan, Plan

_REL_TOL = 1e-6


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=1e-12)


@dataclass(frozen=True, slots=True)
class MicroBatchSpan:
    """When one micro-batch runs on its group, seconds from the start of the step."""

    start_s: float
    end_s: float
    peak_mem_bytes: float


@dataclass(frozen=True, slots=True)
class GroupTimeline:
    """One group's micro-batches laid end to end."""

    first_rank: int
    size: int
    spans: list[MicroBatchSpan]

    @property
    def busy_s(self) -> float:
        """Time the group computes."""
        return self.spans[-1].end_s if self.spans else 0.0


@dataclass(frozen=True, slots=True)
class SimulationReport:
    """What the cost model says the plan does."""

    timelines: list[GroupTimeline]
    compute_makespan_s: float
    """Slowest group's time."""
    grad_sync_time_s: float
    step_time_s: float
    """Compute makespan plus gradient sync."""
    idle_fraction: float
    """Share of rank-seconds of the compute phase spent waiting for the slowest group."""
    peak_mem_bytes_per_rank: list[float]
    """Peak bytes of every rank (model states alone for ranks of idle groups)."""


def group_layout(group: GroupPlan, cost_model: CostModel) -> GroupLayout | None:
    """The cost model's layout of a group: None for pure Ulysses (``ring_degree == 1``, priced as
    before rings existed), else its ``u x r`` on its placement (:meth:`CostModel.place`)."""
    if group.ring_degree == 1:
        return None
    return cost_model.place(first_rank=group.first_rank, group_size=group.size, ring_degree=group.ring_degree)


def simulate(plan: Plan, cost_model: CostModel) -> SimulationReport:
    """Replay a plan on the cost model (not on the plan's own predictions)."""
    gpn = cost_model.cluster.gpus_per_node
    timelines: list[GroupTimeline] = []
    peak = [cost_model.fixed_bytes()] * plan.num_ranks
    for group in plan.groups:
        nodes = nodes_spanned(first_rank=group.first_rank, group_size=group.size, gpus_per_node=gpn)
        layout = group_layout(group, cost_model)
        clock = 0.0
        spans = []
        for mb in group.micro_batches:
            samples = [ps.sample for ps in mb.samples]
            ks = [ps.recompute_layers for ps in mb.samples]
            t = cost_model.microbatch_time_s(samples, group_size=group.size, recompute_layers=ks,
                                             num_nodes=nodes, layout=layout)
            mem = cost_model.microbatch_peak_bytes(samples, group_size=group.size,
                                                   recompute_layers=ks, layout=layout)
            spans.append(MicroBatchSpan(start_s=clock, end_s=clock + t, peak_mem_bytes=mem))
            clock += t
            for r in group.ranks:
                if r < plan.num_ranks:
                    peak[r] = max(peak[r], mem)
        timelines.append(GroupTimeline(first_rank=group.first_rank, size=group.size, spans=spans))
    makespan = max((tl.busy_s for tl in timelines), default=0.0)
    busy = sum(tl.busy_s * tl.size for tl in timelines)
    idle = 1.0 - busy / (plan.num_ranks * makespan) if makespan > 0 else 0.0
    sync = cost_model.grad_sync_time_s()
    return SimulationReport(timelines=timelines, compute_makespan_s=makespan, grad_sync_time_s=sync,
                            step_time_s=makespan + sync, idle_fraction=idle,
                            peak_mem_bytes_per_rank=peak)


def _check_samples(plan: Plan, samples: Sequence[Sample]) -> list[str]:
    problems: list[str] = []
    expected = {s.id: s for s in samples}
    if len(expected) != len(samples):
        dup = [i for i, c in Counter(s.id for s in samples).items() if c > 1]
        problems.append(f"the batch itself repeats sample ids {sorted(dup)[:5]}")
    seen = Counter(plan.sample_ids)
    for sid, count in sorted(seen.items()):
        if sid not in expected:
            problems.append(f"sample {sid!r} is in the plan but not in the batch")
        elif count > 1:
            problems.append(f"sample {sid!r} appears {count} times")
    missing = [sid for sid in expected if sid not in seen]
    if missing:
        problems.append(f"{len(missing)} samples of the batch are missing, e.g. {missing[:5]}")
    for g in plan.groups:
        for mb in g.micro_batches:
            for ps in mb.samples:
                ref = expected.get(ps.sample.id)
                if ref is not None and ref != ps.sample:
                    problems.append(f"sample {ps.sample.id!r} has a different shape in the plan")
    return problems


def _check_groups(plan: Plan, cost_model: CostModel) -> list[str]:
    problems: list[str] = []
    n, gpn = cost_model.cluster.num_gpus, cost_model.cluster.gpus_per_node
    if plan.num_ranks != n:
        problems.append(f"plan is for {plan.num_ranks} ranks, the cluster has {n}")
    ranks = sorted(r for g in plan.groups for r in g.ranks)
    if ranks != list(range(plan.num_ranks)):
        problems.append("groups do not partition the ranks")
    model = cost_model.file.model
    allowed = set(model.allowed_group_sizes(max_size=plan.num_ranks))
    for g in plan.groups:
        if g.ring_degree > 1:
            problems += _check_ring_layout(g, cost_model)
        elif g.size not in allowed:
            problems.append(f"group at rank {g.first_rank} has size {g.size}, which the heads do not allow "
                            f"(num_heads={model.num_heads}, kv_heads={model.kv_heads}: a size divides the "
                            "query heads and divides the key/value heads or is a multiple of them)")
        if g.size <= gpn and nodes_spanned(first_rank=g.first_rank, group_size=g.size,
                                           gpus_per_node=gpn) > 1:
            problems.append(f"group of size {g.size} at rank {g.first_rank} straddles nodes "
                            f"of {gpn} GPUs")
    return problems


def _check_ring_layout(g: GroupPlan, cost_model: CostModel) -> list[str]:
    """A Ulysses x ring group (issue 25): the Ulysses degree is one the heads allow, the model's
    attention is whole-sample (a ring does not cut 2D spatial/temporal attention), and every sample
    cuts into the ``2 x ring_degree`` zig-zag chunks (executor/ring_layout.py). The cost model
    prices the layout (``costmodel.evaluate``, ``layout``)."""
    model = cost_model.file.model
    where = (f"group at rank {g.first_rank} (size {g.size}, ulysses_degree={g.ulysses_degree} x "
             f"ring_degree={g.ring_degree})")
    problems = []
    if g.ulysses_degree not in model.allowed_group_sizes(max_size=g.ulysses_degree):
        problems.append(f"{where}: ulysses_degree={g.ulysses_degree} is not allowed by the heads "
                        f"(num_heads={model.num_heads}, kv_heads={model.kv_heads})")
    if model.kind == "2d":
        problems.append(f"{where}: a ring cannot split the 2D model's spatial and temporal attention")
    if model.joint_attention_tokens:  # executor/joint.py runs joint text attention on pure Ulysses only
        problems.append(f"{where}: model {model.name!r} joins {model.joint_attention_tokens} text tokens to every "
                        "self-attention (joint attention), which runs on pure Ulysses groups only")
    for mb in g.micro_batches:
        for ps in mb.samples:
            if ps.sample.tokens < 2 * g.ring_degree:
                problems.append(f"{where}: sample {ps.sample.id!r} has {ps.sample.tokens} tokens, fewer than the "
                                f"{2 * g.ring_degree} chunks (2 x ring_degree) a ring cuts every sample into")
    return problems


def _check_costs(plan: Plan, cost_model: CostModel) -> list[str]:
    problems: list[str] = []
    cap = cost_model.cluster.memory_cap_bytes
    layers = cost_model.num_layers
    report = simulate(plan, cost_model)
    for g, tl in zip(plan.groups, report.timelines, strict=True):
        where = f"group at rank {g.first_rank}"
        for m, (mb, span) in enumerate(zip(g.micro_batches, tl.spans, strict=True)):
            for ps in mb.samples:
                if not 0 <= ps.recompute_layers <= layers:
                    problems.append(f"{where}: sample {ps.sample.id!r} recomputes "
                                    f"{ps.recompute_layers} layers, outside [0, {layers}]")
            if span.peak_mem_bytes > cap * (1 + 1e-12):
                problems.append(f"{where}, micro-batch {m}: peak {fmt_bytes(span.peak_mem_bytes)} "
                                f"({span.peak_mem_bytes:,.0f} bytes) exceeds the cap {fmt_bytes(cap)} "
                                f"({cap:,.0f} bytes)")
            if not _close(mb.predicted_time_s, span.end_s - span.start_s):
                problems.append(f"{where}, micro-batch {m}: predicted {mb.predicted_time_s:.9g} s, "
                                f"cost model {span.end_s - span.start_s:.9g} s")
            if not _close(mb.predicted_peak_mem_bytes, span.peak_mem_bytes):
                problems.append(f"{where}, micro-batch {m}: predicted peak "
                                f"{mb.predicted_peak_mem_bytes:.9g}, cost model "
                                f"{span.peak_mem_bytes:.9g}")
        if not _close(g.predicted_time_s, tl.busy_s):
            problems.append(f"{where}: predicted {g.predicted_time_s:.9g} s, "
                            f"cost model {tl.busy_s:.9g} s")
    if not _close(plan.grad_sync_time_s, report.grad_sync_time_s):
        problems.append(f"grad sync predicted {plan.grad_sync_time_s:.9g} s, "
                        f"cost model {report.grad_sync_time_s:.9g} s")
    if not _close(plan.predicted_step_time_s, report.step_time_s):
        problems.append(f"step time predicted {plan.predicted_step_time_s:.9g} s, "
                        f"cost model {report.step_time_s:.9g} s")
    if plan.lower_bound.value_s > report.step_time_s * (1 + _REL_TOL):
        problems.append(f"lower bound {plan.lower_bound.value_s:.9g} s exceeds the step time "
                        f"{report.step_time_s:.9g} s")
    else:  # equal to a plan nothing proved optimal, or a proof the plan's status does not have
        problem = bound_problem(plan.lower_bound.value_s, plan.lower_bound.kind, report.step_time_s,
                                status=plan.solver.status, tie_witnessed=plan_witnesses_tie(plan))
        if problem is not None:
            problems.append(problem)
    return problems


def validate_plan(plan: Plan, samples: Sequence[Sample], *, cost_model: CostModel) -> list[str]:
    """Every broken invariant of a plan for a batch, as readable sentences (empty if valid).

    Args:
        plan: The plan to check.
        samples: The batch it must execute (each sample exactly once).
        cost_model: The cost model bound to the cluster the plan is for.
    """
    problems = _check_samples(plan, samples)
    problems += _check_groups(plan, cost_model)
    if plan.cost_model_id != cost_model.file.id:
        problems.append(f"plan was made with cost model {plan.cost_model_id!r}, "
                        f"not {cost_model.file.id!r}")
    if plan.cluster_name != cost_model.cluster.name:
        problems.append(f"plan is for cluster {plan.cluster_name!r}, not {cost_model.cluster.name!r}")
    expected_total = (sum(s.tokens for s in samples) if plan.loss_normalizer.kind == "tokens"
                      else len(samples))
    if plan.loss_normalizer.total != expected_total:
        problems.append(f"loss normaliser total {plan.loss_normalizer.total} != "
                        f"{expected_total} {plan.loss_normalizer.kind} in the batch")
    if plan.num_ranks == cost_model.cluster.num_gpus:
        problems += _check_costs(plan, cost_model)
    return problems


def assert_valid_plan(plan: Plan, samples: Sequence[Sample], *, cost_model: CostModel) -> None:
    """Raise if the plan breaks any invariant.

    Raises:
        ValueError: listing every problem found.
    """
    problems = validate_plan(plan, samples, cost_model=cost_model)
    if problems:
        raise ValueError(f"invalid plan ({len(problems)} problems): " + "; ".join(problems[:20]))
