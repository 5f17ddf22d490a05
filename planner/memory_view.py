"""A plan's predicted peak memory per micro-batch, split the way users read a memory estimate.

The parts are those DeepSpeed's memory estimators and the ZeRO paper (Rajbhandari et al., 2020)
use, plus the activations: per rank of a group, while a micro-batch runs,

* ``params_bytes``, ``grads_bytes``, ``optimizer_bytes``: the model states under the cluster's
  sync mode and sharding (``CostModel.model_state``);
* ``fixed_working_bytes``: buffers every micro-batch holds whatever its samples
  (``CostModel.fixed_working_bytes``: allocator slack, communication buffers, per-layer
  workspaces, the chunked LM loss's one chunk of logits);
* ``activations_bytes``: what the micro-batch's samples keep for backward under their checkpoint
  policies;
* ``token_working_bytes``: the per-token working set on top of them (the loss: whole logits
  with ``loss_chunk_tokens = 0``, else its log-sum-exp; all-to-all buffers, the largest layer's
  backward transients, a ring's key/value buffers, ``CostModel.ring_buffer_bytes``);
* ``margin_bytes``: the memory cap minus all of the above (the cap is the share of device memory
  a plan may use, ``ClusterSpec.memory_cap_fraction``).

Like ``planner.timeline``, the split has no formula of its own: the activations are
``CostModel.activation_bytes`` under a copy of the cost model without the per-token working
terms, the token working set the difference to the full figure, and the parts add up to
``CostModel.microbatch_peak_bytes``, checked against the plan's own prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from costmodel.evaluate import CostModel
from planner.plan import Plan
from planner.validate import group_layout

_REL_TOL = 1e-6
"""Relative tolerance between the plan's predicted peaks and the cost model's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatchMemory:
    """One micro-batch's predicted peak per rank of its group, by part (bytes)."""

    index: int
    """Position in the group's order."""
    params_bytes: float
    """bf16 parameters."""
    grads_bytes: float
    """bf16 gradients (and DDP buckets)."""
    optimizer_bytes: float
    """fp32 master parameters and Adam moments."""
    fixed_working_bytes: float
    """Buffers of any micro-batch."""
    activations_bytes: float
    """Activations the samples keep for backward."""
    token_working_bytes: float
    """Per-token working set on top of them."""
    cap_bytes: float
    """The memory cap a plan must stay under."""

    @property
    def peak_bytes(self) -> float:
        """All parts together: the micro-batch's predicted peak."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.fixed_working_bytes
                + self.activations_bytes + self.token_working_bytes)

    @property
    def margin_bytes(self) -> float:
        """Cap minus peak (negative: over the cap)."""
        return self.cap_bytes - self.peak_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupMemory:
    """One group's micro-batches' memory, with a measured peak when ranks reported one."""

    first_rank: int
    """Lowest rank of the group."""
    size: int
    """Ranks in the group."""
    micro_batches: list[MicroBatchMemory]
    """In execution order (empty for a group with no work)."""
    measured_peak_bytes: float | None = None
    """The largest peak its ranks reported for this plan, if any."""

    @property
    def peak_bytes(self) -> float:
        """The group's predicted peak (its largest micro-batch; 0 without work)."""
        return max((mb.peak_bytes for mb in self.micro_batches), default=0.0)


def without_token_working(cost_model: CostModel) -> CostModel:
    """The same cost model with no per-token working set (activations kept only)."""
    act = cost_model.file.activation.model_copy(update={
        "working_bytes_per_token": 0.0, "transient_bytes_per_token": 0.0, "alltoall_buffer_bytes_per_token": 0.0,
        "head_transient_bytes_per_token": 0.0,
        # a fitted recomputed layer holds its working set too: kept-only counts its activations (none)
        "recomputed_layer_bytes_per_token": None})
    return CostModel(file=cost_model.file.model_copy(update={"activation": act}), cluster=cost_model.cluster)


def plan_memory(plan: Plan, cost_model: CostModel, *,
                measured_peaks_bytes: dict[int, float] | None = None) -> list[GroupMemory]:
    """Every group's micro-batches split by part (module docstring), in rank order.

    Args:
        plan: The plan.
        cost_model: The cost model it was made with, bound to its cluster.
        measured_peaks_bytes: Measured peak per group, keyed by first rank (optional).

    Raises:
        ValueError: when the plan is for another world, or a micro-batch's predicted peak is not
            the cost model's (another cost model or cluster).
    """
    if plan.num_ranks != cost_model.cluster.num_gpus:
        raise ValueError(f"plan is for {plan.num_ranks} ranks, cluster {cost_model.cluster.name!r} "
                         f"has {cost_model.cluster.num_gpus}")
    kept_only = without_token_working(cost_model)
    states = cost_model.model_state()
    optimizer = states.fp32_state_bytes
    fixed_working = cost_model.fixed_working_bytes()
    cap = cost_model.cluster.memory_cap_bytes
    measured = measured_peaks_bytes or {}
    out: list[GroupMemory] = []
    for group in sorted(plan.groups, key=lambda g: g.first_rank):
        parts: list[MicroBatchMemory] = []
        layout = group_layout(group, cost_model)
        for m, mb in enumerate(group.micro_batches):
            tokens = [ps.sample.tokens for ps in mb.samples]
            ks = [ps.recompute_layers for ps in mb.samples]
            total = cost_model.microbatch_peak_bytes([ps.sample for ps in mb.samples], group_size=group.size,
                                                     recompute_layers=ks, layout=layout)
            if not math.isclose(total, mb.predicted_peak_mem_bytes, rel_tol=_REL_TOL):
                raise ValueError(
                    f"group at rank {group.first_rank}, micro-batch {m}: the plan predicts a peak of "
                    f"{mb.predicted_peak_mem_bytes:.6g} bytes, cost model {cost_model.file.id!r} gives "
                    f"{total:.6g}: use the cost model and cluster the plan was made with")
            full_act = float(cost_model.activation_bytes(tokens, group_size=group.size, recompute_layers=ks,
                                                         layout=layout).sum())
            kept = float(kept_only.activation_bytes(tokens, group_size=group.size, recompute_layers=ks,
                                                    layout=layout).sum()
                         - cost_model.ring_buffer_bytes(tokens, layout=layout).sum())  # working, not kept
            parts.append(MicroBatchMemory(
                index=m, params_bytes=states.params_bytes, grads_bytes=states.grads_bytes,
                optimizer_bytes=optimizer, fixed_working_bytes=fixed_working, activations_bytes=kept,
                token_working_bytes=full_act - kept, cap_bytes=cap))
        out.append(GroupMemory(first_rank=group.first_rank, size=group.size, micro_batches=parts,
                               measured_peak_bytes=measured.get(group.first_rank)))
    return out
