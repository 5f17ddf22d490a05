"""Drafts (the solvers' internal plans) and their exact evaluation and assembly into a ``Plan``.

A draft names, per group, its size, its first rank, its attention layout (``ring_degree``: Ulysses
over ``size / ring_degree`` ranks x ring over ``ring_degree``) and its ordered micro-batches of
``(sample index, recompute layers)``. Every number in the assembled plan comes from the cost
model for the actual placement (nodes spanned), never from a solver's approximation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from costmodel.evaluate import CostModel, GroupLayout, nodes_spanned
from costmodel.specs import Sample
from planner.costs import SampleClasses
from planner.plan import (
    GroupPlan,
    LossNormalizer,
    LowerBound,
    MicroBatch,
    Plan,
    PlannedSample,
    SolverInfo,
    SolverStatus,
)


@dataclass(slots=True)
class DraftGroup:
    """One group of a draft: contiguous ranks ``[first_rank, first_rank + size)``."""

    size: int
    first_rank: int
    micro_batches: list[list[tuple[int, int]]] = field(default_factory=list)
    """Ordered micro-batches of ``(sample index, recompute layers)``."""
    ring_degree: int = 1
    """Ring degree of the group's attention layout (1: pure Ulysses)."""


Draft = list[DraftGroup]

_Model = TypeVar("_Model", bound=BaseModel)


def trusted_model(model: type[_Model], values: dict[str, Any]) -> _Model:
    """``model.model_construct(**values)`` for values that name every field of a model without
    aliases, defaults to fill, private attributes or a post-init hook (the plan's
    ``PlannedSample`` and ``MicroBatch``).

    The same instance as pydantic's ``model_construct`` (its ``__dict__``, fields set, no extra,
    no private values; ``tests/planner/test_assemble_trusted.py`` compares the two), without its
    per-field loop: a 131,072-sample plan builds ~160,000 of them; 131,072 ``PlannedSample`` take
    0.21 s through ``model_construct`` and 0.09 s here (one process, best of 3, load 1.1).

    Args:
        model: The pydantic model class.
        values: Every field's value, by field name (taken as the instance's ``__dict__``).

    Returns:
        The instance, unvalidated.
    """
    instance = model.__new__(model)
    object.__setattr__(instance, "__dict__", values)
    object.__setattr__(instance, "__pydantic_fields_set__", set(values))
    object.__setattr__(instance, "__pydantic_extra__", None)
    object.__setattr__(instance, "__pydantic_private__", None)
    return instance


@dataclass(frozen=True, slots=True)
class BatchArrays:
    """Shapes of the batch as arrays (sample order), for vectorised cost evaluation."""

    tokens: np.ndarray
    frames: np.ndarray
    spatial: np.ndarray

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> BatchArrays:
        """Arrays of tokens, frames and tokens per frame."""
        return cls(tokens=np.array([s.tokens for s in samples], dtype=np.float64),
                   frames=np.array([s.num_frames for s in samples], dtype=np.float64),
                   spatial=np.array([s.spatial_tokens for s in samples], dtype=np.float64))

    @classmethod
    def of_classes(cls, classes: SampleClasses) -> BatchArrays:
        """The same arrays gathered from the batch's shape classes (``CostTable.classes``):
        samples of one class have one shape (frames, tokens per frame) and so one token count
        (a validated 2D sample's tokens are its frames x height x width), without reading
        131,072 samples' fields."""
        of = np.asarray(classes.class_of, dtype=np.int64)
        return cls(tokens=classes.tokens[of], frames=classes.frames[of], spatial=classes.spatial[of])


@dataclass(frozen=True, slots=True)
class GroupCosts:
    """Exact per-sample and per-micro-batch numbers of one group."""

    sample_time_s: np.ndarray
    sample_act_bytes: np.ndarray
    microbatch_time_s: list[float]
    microbatch_peak_bytes: list[float]

    @property
    def time_s(self) -> float:
        """Sum of the micro-batch times."""
        return float(sum(self.microbatch_time_s))


def group_costs(group: DraftGroup, arrays: BatchArrays, cost_model: CostModel) -> GroupCosts:
    """Exact costs of one draft group under the cost model."""
    return draft_costs([group], arrays, cost_model)[0]


Placement = tuple[int, int, GroupLayout | None]
"""``(size, nodes spanned, layout)`` of a group: what its costs depend on besides its samples."""


def _by_placement(draft: Draft, cost_model: CostModel) -> dict[Placement, list[int]]:
    """Groups with micro-batches by placement (size, nodes spanned, ring layout), in draft order."""
    gpn = cost_model.cluster.gpus_per_node
    buckets: dict[Placement, list[int]] = {}
    for gi, g in enumerate(draft):
        if g.micro_batches:
            nodes = nodes_spanned(first_rank=g.first_rank, group_size=g.size, gpus_per_node=gpn)
            layout = None if g.ring_degree == 1 else cost_model.place(
                first_rank=g.first_rank, group_size=g.size, ring_degree=g.ring_degree)
            buckets.setdefault((g.size, nodes, layout), []).append(gi)
    return buckets


def _sample_times(mbs: list[list[tuple[int, int]]], arrays: BatchArrays, cost_model: CostModel,
                  *, size: int, nodes: int, layout: GroupLayout | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[float]]:
    """Samples' seconds of micro-batches on one placement, and each micro-batch's seconds:
    ``(sample indices, policies, micro-batch start offsets, sample seconds, micro-batch
    seconds)``."""
    # (sample, policy) pairs flattened: numpy reads a flat stream of ints twice as fast as tuples.
    pairs = np.fromiter(chain.from_iterable(chain.from_iterable(mbs)), dtype=np.int64).reshape(-1, 2)
    idx, ks = pairs[:, 0], pairs[:, 1]
    # Start offset of every micro-batch, all groups in order.
    starts = np.asarray(np.cumsum([0] + [len(mb) for mb in mbs[:-1]]), dtype=np.int64)
    times = np.asarray(cost_model.sample_time_s(
        arrays.tokens[idx], group_size=size, recompute_layers=ks, frames=arrays.frames[idx],
        spatial=arrays.spatial[idx], num_nodes=nodes, layout=layout), dtype=np.float64)
    # CostModel.microbatch_fixed_s for every micro-batch at once: the overhead, one
    # forward+backward call per layer plus one per layer where policies differ, one
    # forward call per recomputed layer (CostModel.layer_calls). The validator recomputes
    # each micro-batch with CostModel.microbatch_time_s itself.
    hi = np.maximum.reduceat(ks, starts)
    lo = np.minimum.reduceat(ks, starts)
    call_f, call_b = cost_model.layer_call_s(group_size=size, num_nodes=nodes, layout=layout)
    fixed_s = (cost_model.file.compute.microbatch_overhead_s
               + (cost_model.num_layers + hi - lo) * (call_f + call_b) + hi * call_f)
    mb_times = fixed_s + np.add.reduceat(times, starts)
    if layout is not None and layout.ring_degree > 1:  # per layer call, not per sample
        mb_times = mb_times + cost_model.ring_exposed_many_s(arrays.tokens[idx], ks, starts, layout=layout)
    return idx, ks, starts, times, mb_times.tolist()


def draft_costs(draft: Draft, arrays: BatchArrays, cost_model: CostModel) -> list[GroupCosts]:
    """Exact costs of every group of a draft (one cost-model call per size and node span)."""
    fixed = cost_model.fixed_bytes()
    out = [GroupCosts(np.zeros(0), np.zeros(0), [], []) for _ in draft]
    for (size, nodes, layout), members in _by_placement(draft, cost_model).items():
        mbs = [mb for gi in members for mb in draft[gi].micro_batches]
        idx, ks, starts, times, mb_times = _sample_times(mbs, arrays, cost_model, size=size,
                                                         nodes=nodes, layout=layout)
        acts = np.asarray(cost_model.activation_bytes(arrays.tokens[idx], group_size=size,
                                                      recompute_layers=ks, layout=layout), dtype=np.float64)
        mb_peaks = (fixed + np.add.reduceat(acts, starts)).tolist()
        pos = first_mb = 0
        for gi in members:
            count = len(draft[gi].micro_batches)
            size_g = sum(len(m) for m in draft[gi].micro_batches)
            out[gi] = GroupCosts(times[pos:pos + size_g], acts[pos:pos + size_g],
                                 mb_times[first_mb:first_mb + count],
                                 mb_peaks[first_mb:first_mb + count])
            pos += size_g
            first_mb += count
    return out


def draft_problems(draft: Draft, arrays: BatchArrays, cost_model: CostModel, *,
                   limit_bytes: float) -> list[str]:
    """What makes a draft unrunnable, as sentences (empty when it runs): a checkpoint policy
    outside ``[0, L]``, or a micro-batch whose peak (model states plus its samples' activations
    at their policies and its group's layout, ``draft_costs``' figure) is over ``limit_bytes``.

    The memory half of ``planner.validate.validate_plan`` on a draft, for the candidates a plan
    is chosen among: activations only (no times), one cost-model call per placement.
    """
    problems: list[str] = []
    layers = cost_model.num_layers
    fixed = cost_model.fixed_bytes()
    for (size, _, layout), members in _by_placement(draft, cost_model).items():
        mbs = [mb for gi in members for mb in draft[gi].micro_batches]
        pairs = np.fromiter(chain.from_iterable(chain.from_iterable(mbs)), dtype=np.int64).reshape(-1, 2)
        idx, ks = pairs[:, 0], pairs[:, 1]
        bad = np.flatnonzero((ks < 0) | (ks > layers))
        if bad.size:
            problems.append(f"{bad.size} samples of groups of size {size} recompute a number of layers outside "
                            f"[0, {layers}] (e.g. sample {int(idx[bad[0]])}: {int(ks[bad[0]])})")
            continue  # the draft is refused already; its bytes at such policies mean nothing
        starts = np.asarray(np.cumsum([0] + [len(mb) for mb in mbs[:-1]]), dtype=np.int64)
        acts = np.asarray(cost_model.activation_bytes(arrays.tokens[idx], group_size=size, recompute_layers=ks,
                                                      layout=layout), dtype=np.float64)
        peaks = fixed + np.add.reduceat(acts, starts)
        over = np.flatnonzero(peaks > limit_bytes * (1 + 1e-12))
        if over.size:
            ring = "" if layout is None else f" (ulysses {size // layout.ring_degree} x ring {layout.ring_degree})"
            problems.append(f"{over.size} micro-batches of groups of size {size}{ring} peak over the limit of "
                            f"{limit_bytes:,.0f} bytes (the largest: {float(peaks[over].max()):,.0f} bytes)")
    return problems


def draft_step_time_s(draft: Draft, arrays: BatchArrays, cost_model: CostModel, *,
                      grad_sync_s: float | None = None) -> float:
    """Predicted step time of a draft: slowest group plus gradient sync.

    The same sums as ``draft_costs`` (``GroupCosts.time_s``), without the memory figures;
    ``grad_sync_s``: ``cost_model.grad_sync_time_s()`` when the caller has it.
    """
    slowest = 0.0
    for (size, nodes, layout), members in _by_placement(draft, cost_model).items():
        mbs = [mb for gi in members for mb in draft[gi].micro_batches]
        mb_times = _sample_times(mbs, arrays, cost_model, size=size, nodes=nodes, layout=layout)[4]
        first_mb = 0
        for gi in members:
            count = len(draft[gi].micro_batches)
            group_s = float(sum(mb_times[first_mb:first_mb + count]))
            slowest = max(slowest, group_s)
            first_mb += count
    return slowest + (cost_model.grad_sync_time_s() if grad_sync_s is None else grad_sync_s)


def loss_normalizer(samples: Sequence[Sample], kind: str) -> LossNormalizer:
    """The global loss normaliser of the step."""
    if kind == "tokens":
        return LossNormalizer(kind="tokens", total=sum(s.tokens for s in samples))
    return LossNormalizer(kind="samples", total=len(samples))


@dataclass(frozen=True, slots=True)
class PlanMeta:
    """What a plan records besides its groups."""

    status: SolverStatus
    method: str
    wall_time_s: float
    lower_bound: LowerBound
    objective_bound_s: float | None = None
    seed: int = 0
    step: int | None = None
    loss_normalization: str = "tokens"
    baselines_s: dict[str, float] = field(default_factory=dict)


def assemble_plan(draft: Draft, samples: Sequence[Sample], *, cost_model: CostModel,
                  meta: PlanMeta, arrays: BatchArrays | None = None) -> Plan:
    """Build the wire ``Plan`` of a draft with exact predicted times and memory."""
    arrays = BatchArrays.of(samples) if arrays is None else arrays
    groups: list[GroupPlan] = []
    slowest = 0.0
    ordered = sorted(draft, key=lambda g: g.first_rank)
    fixed_bytes = cost_model.fixed_bytes()  # an empty group's peak
    for g, costs in zip(ordered, draft_costs(ordered, arrays, cost_model), strict=True):
        mbs: list[MicroBatch] = []
        pos = 0
        times_s, act_bytes = costs.sample_time_s.tolist(), costs.sample_act_bytes.tolist()
        for mb, mb_time, mb_peak in zip(g.micro_batches, costs.microbatch_time_s,
                                        costs.microbatch_peak_bytes, strict=True):
            planned = []
            for i, k in mb:
                planned.append(trusted_model(PlannedSample, {
                    "sample": samples[i], "recompute_layers": int(k), "predicted_time_s": times_s[pos],
                    "predicted_activation_bytes": act_bytes[pos]}))
                pos += 1
            mbs.append(trusted_model(MicroBatch, {"samples": planned, "predicted_time_s": mb_time,
                                                  "predicted_peak_mem_bytes": mb_peak}))
        group_time = costs.time_s
        slowest = max(slowest, group_time)
        peak = max(costs.microbatch_peak_bytes, default=fixed_bytes)
        groups.append(GroupPlan(ranks=list(range(g.first_rank, g.first_rank + g.size)),
                                micro_batches=mbs, predicted_time_s=group_time,
                                predicted_peak_mem_bytes=peak, ring_degree=g.ring_degree))
    sync = cost_model.grad_sync_time_s()
    return Plan(
        step=meta.step,
        num_ranks=cost_model.cluster.num_gpus,
        groups=groups,
        predicted_step_time_s=slowest + sync,
        grad_sync_time_s=sync,
        lower_bound=meta.lower_bound,
        solver=SolverInfo(status=meta.status, method=meta.method, wall_time_s=meta.wall_time_s,
                          objective_bound_s=meta.objective_bound_s, seed=meta.seed),
        loss_normalizer=loss_normalizer(samples, meta.loss_normalization),
        cost_model_id=cost_model.file.id,
        cluster_name=cost_model.cluster.name,
        baselines_s=dict(sorted(meta.baselines_s.items())),
    )
