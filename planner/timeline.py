"""A plan's step laid out in time, each micro-batch split into compute, recompute and all-to-all.

The split uses no formula of its own: every figure is a difference of
``costmodel.evaluate.CostModel.microbatch_time_s`` calls on the plan's own cost model.

* ``alltoall_s``: the micro-batch's time minus its time under the same cost model with the
  all-to-alls removed (``alltoall_ops_per_layer = 0`` and ``alltoall_bytes_per_token_layer = 0``:
  no latency term, no bytes), i.e. every Ulysses all-to-all of forward, backward and recompute;
* ``recompute_s``: without all-to-alls, the time under the plan's checkpoint policies minus the
  time with none (the recomputed forwards and the second call of a layer whose samples mix
  checkpointed and plain ones);
* ``compute_s``: the rest, the time without all-to-alls and without checkpointing;
* ``ring_s``: in a Ulysses x ring group (``GroupPlan.ring_degree > 1``), what its rings add to the
  compute (hops the attention does not hide and the merges, of every layer call, recomputes
  included: ``CostModel.ring_exposed_s``), taken out of the three above; 0 in a Ulysses group.

The four add up to ``microbatch_time_s`` (and to the plan's ``predicted_time_s`` of the
micro-batch, checked). The step ends with the gradient sync (``grad_sync_time_s``) after the
slowest group; a faster group idles from its last micro-batch to that point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.evaluate import CostModel, nodes_spanned
from planner.plan import Plan
from planner.validate import group_layout

_REL_TOL = 1e-6
"""Relative tolerance between the plan's predictions and the cost model's times."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchSegments:
    """One micro-batch on its group's timeline, seconds from the start of the step."""

    index: int
    """Position in the group's order."""
    start_s: float
    """When it starts."""
    compute_s: float
    """Forward and backward without all-to-alls or checkpointing."""
    recompute_s: float
    """What the checkpoint policies add (recomputed forwards, split layer calls)."""
    alltoall_s: float
    """Every all-to-all of the micro-batch (forward, backward, recompute)."""
    ring_s: float = 0.0
    """What its rings add to the compute (Ulysses x ring groups; 0 otherwise)."""
    num_samples: int
    """Samples in the micro-batch."""
    tokens: int
    """Tokens in the micro-batch (all ranks of the group together)."""

    @property
    def time_s(self) -> float:
        """The micro-batch's whole time."""
        return self.compute_s + self.recompute_s + self.alltoall_s + self.ring_s

    @property
    def end_s(self) -> float:
        """When it ends."""
        return self.start_s + self.time_s


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupTimeline:
    """One SP group's micro-batches laid end to end."""

    first_rank: int
    """Lowest rank of the group."""
    size: int
    """Group size (ranks)."""
    micro_batches: list[MicroBatchSegments]
    """In execution order."""

    @property
    def busy_s(self) -> float:
        """When its last micro-batch ends."""
        return self.micro_batches[-1].end_s if self.micro_batches else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimeline:
    """A whole step: every group, then the gradient sync over the world."""

    groups: list[GroupTimeline]
    """Groups in rank order."""
    compute_makespan_s: float
    """When the slowest group ends (the gradient sync starts)."""
    grad_sync_s: float
    """Gradient sync of the step."""
    num_ranks: int
    """World size."""

    @property
    def step_time_s(self) -> float:
        """Makespan plus gradient sync."""
        return self.compute_makespan_s + self.grad_sync_s

    def idle_s(self, group: GroupTimeline) -> float:
        """How long a group waits for the slowest one."""
        return self.compute_makespan_s - group.busy_s

    def totals_rank_s(self) -> dict[str, float]:
        """Rank-seconds of the step by kind: compute, recompute, all-to-all, ring, idle, grad sync."""
        out = {"compute": 0.0, "recompute": 0.0, "alltoall": 0.0, "ring": 0.0, "idle": 0.0, "grad_sync": 0.0}
        for g in self.groups:
            for mb in g.micro_batches:
                out["compute"] += mb.compute_s * g.size
                out["recompute"] += mb.recompute_s * g.size
                out["alltoall"] += mb.alltoall_s * g.size
                out["ring"] += mb.ring_s * g.size
            out["idle"] += self.idle_s(g) * g.size
        out["grad_sync"] = self.grad_sync_s * self.num_ranks
        return out


def without_alltoall(cost_model: CostModel) -> CostModel:
    """The same cost model with every all-to-all removed (no latency term, no bytes)."""
    comm = cost_model.file.comm.model_copy(update={"alltoall_ops_per_layer": 0,
                                                   "alltoall_bytes_per_token_layer": 0.0,
                                                   "alltoall_kv_head_bytes_per_token_layer": 0.0})
    return CostModel(file=cost_model.file.model_copy(update={"comm": comm}), cluster=cost_model.cluster)


def step_timeline(plan: Plan, cost_model: CostModel) -> StepTimeline:
    """The plan's step under ``cost_model``, each micro-batch split by kind (module docstring).

    Args:
        plan: The plan (of any planner or baseline).
        cost_model: The cost model the plan was made with, bound to its cluster.

    Raises:
        ValueError: when the plan is for another world, or a micro-batch's predicted time is not
            the cost model's (the plan was made with another cost model or cluster).
    """
    if plan.num_ranks != cost_model.cluster.num_gpus:
        raise ValueError(f"plan is for {plan.num_ranks} ranks, cluster {cost_model.cluster.name!r} "
                         f"has {cost_model.cluster.num_gpus}")
    bare = without_alltoall(cost_model)
    gpn = cost_model.cluster.gpus_per_node
    groups: list[GroupTimeline] = []
    for group in sorted(plan.groups, key=lambda g: g.first_rank):
        nodes = nodes_spanned(first_rank=group.first_rank, group_size=group.size, gpus_per_node=gpn)
        layout = group_layout(group, cost_model)
        clock = 0.0
        segments: list[MicroBatchSegments] = []
        for m, mb in enumerate(group.micro_batches):
            samples = [ps.sample for ps in mb.samples]
            ks = [ps.recompute_layers for ps in mb.samples]
            full = cost_model.microbatch_time_s(samples, group_size=group.size, recompute_layers=ks,
                                                num_nodes=nodes, layout=layout)
            if not math.isclose(full, mb.predicted_time_s, rel_tol=_REL_TOL, abs_tol=1e-12):
                raise ValueError(
                    f"group at rank {group.first_rank}, micro-batch {m}: the plan predicts "
                    f"{mb.predicted_time_s:.9g} s, cost model {cost_model.file.id!r} on cluster "
                    f"{cost_model.cluster.name!r} gives {full:.9g} s: use the cost model and cluster "
                    f"the plan was made with ({plan.cost_model_id!r}, {plan.cluster_name!r})")
            ring = 0.0 if layout is None else cost_model.ring_exposed_s(
                [s.tokens for s in samples], ks, layout=layout)
            ring0 = 0.0 if layout is None else cost_model.ring_exposed_s(
                [s.tokens for s in samples], [0] * len(ks), layout=layout)
            no_a2a = bare.microbatch_time_s(samples, group_size=group.size, recompute_layers=ks,
                                            num_nodes=nodes, layout=layout) - ring
            plain = bare.microbatch_time_s(samples, group_size=group.size, recompute_layers=[0] * len(ks),
                                           num_nodes=nodes, layout=layout) - ring0
            seg = MicroBatchSegments(index=m, start_s=clock, compute_s=plain,
                                     recompute_s=max(no_a2a - plain, 0.0),
                                     alltoall_s=max(full - ring - no_a2a, 0.0), ring_s=ring,
                                     num_samples=len(samples),
                                     tokens=sum(s.tokens for s in samples))
            segments.append(seg)
            clock = seg.end_s
        groups.append(GroupTimeline(first_rank=group.first_rank, size=group.size,
                                    micro_batches=segments))
    makespan = max((g.busy_s for g in groups), default=0.0)
    return StepTimeline(groups=groups, compute_makespan_s=makespan,
                        grad_sync_s=cost_model.grad_sync_time_s(), num_ranks=plan.num_ranks)
