"""Context parallelism at one fixed size and layout for the whole run (issue 25, item 4).

What a user of Megatron-Core's context parallelism or of a USP hybrid does: pick one CP size
``d`` for the run, the smallest at which the workload's longest sample fits in memory (with
full recomputation allowed), split the world into ``N / d`` data-parallel replicas of ``d``
ranks each with one fixed attention layout ``u x r`` (Ulysses over ``u`` ranks, ring attention
over ``r`` rank-sets, ``executor/ring_layout.py``), and deal every step's samples over the
replicas balanced by tokens.

* ``ring-cp`` (``ring_cp.py``): Megatron-Core's ring context parallelism, ``u = 1``, ``r = d``
  (Megatron-LM ``--context-parallel-size``; Liu et al. 2023, "Ring Attention with Blockwise
  Transformers").
* ``usp`` (``usp.py``): the Ulysses x ring hybrid of Fang and Zhao 2024 ("USP: A Unified
  Sequence Parallelism Approach"), ``u`` fixed at the largest degree the heads allow that
  divides ``d`` and a node (their recommendation: Ulysses inside a node, ring across nodes),
  ``r = d / u``.

Sizes are the divisors of the world (the data-parallel degree is whole, as Megatron requires).
Each replica's samples go longest first (by tokens) to the replica with the fewest tokens so far
(Megatron balances its packed sequences by token count), then are packed first-fit decreasing
by bytes at each sample's cheapest fitting checkpoint policy on the layout (as ``static-best``
packs). A step the fixed layout cannot hold (a sample does not fit the replica's memory, or has
fewer tokens than the ``2 r`` zig-zag chunks a ring cuts it into), or a layout the planner's
configuration does not allow (``CostTable.ring_options``: ``PlannerConfig.layout="ulysses"`` allows
no ring, ``"ring"`` no hybrid), makes the baseline's draft None: the registry reports it as not
holding the batch. The layout is the baseline's own: ``planner.layouts.apply_layouts`` leaves it
(``Baseline.fixed_layout``).

Every number comes from ``costmodel.evaluate.CostModel`` at the layout (``ring_degree``), so the
draft is costed and validated like any plan.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from costmodel.evaluate import CostModel
from costmodel.specs import Sample
from planner.assemble import Draft, DraftGroup
from planner.baselines.common import first_fit, place_layout
from planner.costs import CostTable

LayoutRule = Callable[[CostModel, int], int]
"""A baseline's ring degree ``r`` at CP size ``d`` (``u = d / r``)."""


def cheapest_policies(cost_model: CostModel, tokens: Sequence[float] | np.ndarray, *, size: int,
                      ring_degree: int, budget_bytes: float) -> tuple[np.ndarray, np.ndarray]:
    """Per sample, the fewest recomputed layers with which it fits the activation budget alone on
    a group of ``size`` ranks split ``size / ring_degree`` x ``ring_degree``, and its bytes there:
    ``(k_min, bytes)``, ``k_min = -1`` where none fits.

    The cost model is evaluated at every ``k`` in ``[0, L - 1]`` (``k = L`` is dominated by
    ``L - 1``, ``common.full_checkpoint_layers``); a sample with fewer tokens than the ``2 r``
    chunks of the ring never fits.
    """
    s = np.asarray(tokens, dtype=np.float64)
    layout = cost_model.place(first_rank=0, group_size=size, ring_degree=ring_degree)  # bytes: placement-free
    ks = np.arange(max(cost_model.num_layers - 1, 0) + 1, dtype=np.float64)[:, None]
    act = np.broadcast_to(np.asarray(cost_model.activation_bytes(s[None, :], group_size=size, recompute_layers=ks,
                                                                 layout=layout), dtype=np.float64),
                          (len(ks), len(s)))
    ok = (act <= budget_bytes) & (s >= (2 * ring_degree if ring_degree > 1 else 1))[None, :]
    k_min = np.where(ok.any(axis=0), ok.argmax(axis=0), -1)
    return k_min, act[np.maximum(k_min, 0), np.arange(len(s))]


def cp_size(table: CostTable, longest: Sample, *, rule: LayoutRule) -> tuple[int, int] | None:
    """``(d, r)``: the smallest divisor ``d`` of the world on which ``longest`` fits alone under the
    rule's ring degree ``r`` (None when it fits none)."""
    cm = table.cost_model
    n = cm.cluster.num_gpus
    for d in (d for d in range(1, n + 1) if n % d == 0):
        r = rule(cm, d)
        k_min, _ = cheapest_policies(cm, [longest.tokens], size=d, ring_degree=r, budget_bytes=table.budget_bytes)
        if k_min[0] >= 0:
            return d, r
    return None


def fixed_cp_draft(table: CostTable, *, rule: LayoutRule, reference: Sample | None) -> Draft | None:
    """``N / d`` replicas of one layout, samples balanced by tokens, packed at cheapest policies.

    Args:
        table: The batch's cost table (its samples, cost model and activation budget).
        rule: The baseline's layout at a CP size.
        reference: The workload's longest sample, which fixes ``d`` for the run; None: the
            batch's longest.

    Returns:
        The draft, None when the layout cannot hold the batch (see the module docstring).
    """
    cm = table.cost_model
    if cm.file.model.kind == "2d":
        return None  # a ring cannot split spatial and temporal attention (planner/validate.py)
    samples = table.samples
    longest = reference if reference is not None else max(samples, key=lambda s: s.tokens)
    chosen = cp_size(table, longest, rule=rule)
    if chosen is None:
        return None
    size, ring_degree = chosen
    if ring_degree not in table.ring_options.get(size, ()):
        return None  # the planner's layouts (PlannerConfig.layout) do not allow this one
    num_replicas = cm.cluster.num_gpus // size
    groups = place_layout([size] * num_replicas, table)
    if groups is None:
        return None
    # Policies and bytes per class (elementwise in the tokens: the same values per sample).
    k_cls, mem_cls = cheapest_policies(cm, table.classes.tokens, size=size, ring_degree=ring_degree,
                                       budget_bytes=table.budget_bytes)
    class_of = np.asarray(table.classes.class_of, dtype=np.int64)
    if (k_cls[class_of] < 0).any():
        return None
    replica = balanced_replicas(table, num_replicas)
    # Each replica's samples by decreasing bytes, ties by index: one global order dealt out
    # (the same lists as sorting each replica's, without a key call per sample).
    mem = mem_cls[class_of]
    members: list[list[int]] = [[] for _ in range(num_replicas)]
    by_bytes = np.lexsort((np.arange(len(mem)), -mem))
    for i, g in zip(by_bytes.tolist(), replica[by_bytes].tolist(), strict=True):
        members[g].append(i)
    out: Draft = []
    # Plain lists: 131,072 numpy scalar reads per draft cost more than the conversion.
    mem_c, policies_c, cls = mem_cls.tolist(), k_cls.tolist(), table.classes.class_of
    for g, group in enumerate(groups):
        order = members[g]
        out.append(DraftGroup(size=group.size, first_rank=group.first_rank, ring_degree=ring_degree,
                              micro_batches=first_fit(order, [mem_c[cls[i]] for i in order], table.budget_bytes,
                                                      [policies_c[cls[i]] for i in order])))
    return out


_REPLICAS: weakref.WeakKeyDictionary[CostTable, dict[int, np.ndarray]] = weakref.WeakKeyDictionary()
"""``balanced_replicas`` per live cost table and number of replicas (``ring-cp`` and ``usp``
often share the CP size)."""


def balanced_replicas(table: CostTable, num_replicas: int) -> np.ndarray:
    """Every sample's replica: longest first (ties by index) to the replica with the fewest
    tokens so far (ties: the lower replica), as Megatron balances its sequences."""
    cached = _REPLICAS.setdefault(table, {})
    if num_replicas in cached:
        return cached[num_replicas]
    tokens = table.classes.tokens[table.classes.class_of]  # every sample's, through its class
    heap = [(0.0, g) for g in range(num_replicas)]  # (tokens so far, replica)
    replica = [0] * len(tokens)
    token_list = tokens.tolist()
    for i in np.argsort(-tokens, kind="stable").tolist():  # longest first, ties by index
        load, g = heap[0]
        replica[i] = g
        heapq.heapreplace(heap, (load + token_list[i], g))
    cached[num_replicas] = out = np.asarray(replica, dtype=np.int64)
    return out
