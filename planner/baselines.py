"""Baselines under the same cost model (DESIGN.md, 'Baselines').

* ``bucket``: one fixed SP size ``d`` for every sample: by default the smallest allowed size on
  which the reference sample (the workload's longest, else the batch's longest) fits with full
  checkpointing. ``N // d`` groups; samples dealt round-robin in sampler order; full
  checkpointing; one micro-batch per group, except that a group whose samples together exceed
  the memory cap splits them first-fit (in sampler order) into as few micro-batches as needed.
  Ranks left over when ``d`` does not divide ``N`` stay idle in groups of allowed sizes.
* ``bucket_sp4``: the same at the fixed size 4 that the published DCP baseline used.
* ``packed``: the same fixed size; samples packed into micro-batches up to the token budget
  that fits memory under full checkpointing, assigned longest first to the group with the
  fewest tokens (balanced by tokens), packed first-fit-decreasing inside each group.
* ``greedy``: Megatron Dynamic-CP style. Each sample needs the power-of-two size
  ``ceil(s / max_tokens_per_rank)`` rounded up (``max_tokens_per_rank``: tokens a rank holds
  without recomputation), at least the smallest size on which it fits; longest first, each
  sample tries every allowed size at least that large (a new group while ranks are free, or
  the least-loaded existing group) and keeps the placement with the lowest projected maximum
  group load. Each sample runs at its cheapest fitting policy; groups pack first-fit.

A baseline that cannot hold the batch (a sample does not fit its fixed size) is skipped.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from costmodel.specs import Sample
from planner.assemble import Draft, DraftGroup
from planner.costs import CostTable
from planner.placement import fill_ranks, place_groups


def bucket_size(table: CostTable, *, reference: Sample | None = None) -> int:
    """Smallest allowed size that fits the reference sample with full checkpointing.

    Raises:
        ValueError: when no allowed size fits it.
    """
    cm = table.cost_model
    ref = reference if reference is not None else max(table.samples, key=lambda s: s.tokens)
    for d in table.sizes:
        act = float(cm.activation_bytes(ref.tokens, group_size=d, recompute_layers=cm.num_layers))
        if act <= table.budget_bytes:
            return d
    raise ValueError(f"sample {ref.id!r} ({ref.tokens} tokens) fits no allowed group size "
                     f"{table.sizes} even with full checkpointing")


def _fixed_groups(table: CostTable, d: int) -> tuple[list[DraftGroup], list[DraftGroup]] | None:
    """Working groups of size ``d`` and idle filler groups, placed; None if impossible."""
    cluster = table.cost_model.cluster
    n = cluster.num_gpus
    num_work = n // d
    filler = fill_ranks(n - num_work * d, table.sizes)
    if num_work == 0 or filler is None:
        return None
    placed = place_groups([d] * num_work + filler, num_gpus=n, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    work: list[DraftGroup] = []
    idle: list[DraftGroup] = []
    for size, first in placed:
        group = DraftGroup(size=size, first_rank=first)
        (work if size == d and len(work) < num_work else idle).append(group)
    return work, idle


def _first_fit(items: Sequence[int], mem: Sequence[float], budget: float, k: Sequence[int]
               ) -> list[list[tuple[int, int]]]:
    mbs: list[list[tuple[int, int]]] = []
    free: list[float] = []
    for pos, i in enumerate(items):
        for m, f in enumerate(free):
            if f >= mem[pos]:
                mbs[m].append((i, k[pos]))
                free[m] -= mem[pos]
                break
        else:
            mbs.append([(i, k[pos])])
            free.append(budget - mem[pos])
    return mbs


def _full_mem(table: CostTable, d: int) -> np.ndarray:
    cm = table.cost_model
    tokens = np.array([s.tokens for s in table.samples], dtype=np.float64)
    return np.asarray(cm.activation_bytes(tokens, group_size=d, recompute_layers=cm.num_layers))


def _fixed_setup(table: CostTable, group_size: int
                 ) -> tuple[np.ndarray, list[DraftGroup], list[DraftGroup]] | None:
    """Full-checkpointing bytes per sample and the fixed-size groups (working, idle), or None
    when a sample does not fit the size or the size does not tile the world."""
    mem = _full_mem(table, group_size)
    if (mem > table.budget_bytes).any():
        return None
    groups = _fixed_groups(table, group_size)
    if groups is None:
        return None
    work, idle = groups
    return mem, work, idle


def bucket_draft(table: CostTable, *, group_size: int) -> Draft | None:
    """The bucket-parallel draft at a fixed size (None if a sample does not fit it)."""
    layers = table.cost_model.num_layers
    setup = _fixed_setup(table, group_size)
    if setup is None:
        return None
    mem, work, idle = setup
    dealt: list[list[int]] = [[] for _ in work]
    for i in range(len(table.samples)):
        dealt[i % len(work)].append(i)
    for g, items in zip(work, dealt, strict=True):
        g.micro_batches = _first_fit(items, [mem[i] for i in items], table.budget_bytes,
                                     [layers] * len(items))
    return work + idle


def packed_draft(table: CostTable, *, group_size: int) -> Draft | None:
    """The packed-parallel draft at a fixed size (None if a sample does not fit it)."""
    cm = table.cost_model
    layers = cm.num_layers
    setup = _fixed_setup(table, group_size)
    if setup is None:
        return None
    mem, work, idle = setup
    per_token = float(cm.activation_bytes(1, group_size=group_size, recompute_layers=layers))
    token_budget = max(1, math.floor(table.budget_bytes / per_token))
    tokens = [s.tokens for s in table.samples]
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    heap = [(0, g) for g in range(len(work))]  # (tokens so far, group)
    members: list[list[int]] = [[] for _ in work]
    for i in order:
        load, target = heapq.heappop(heap)
        members[target].append(i)
        heapq.heappush(heap, (load + tokens[i], target))
    for g, items in zip(work, members, strict=True):
        # Token-budget packing; memory is checked as well (a budget in tokens is exact here).
        mbs: list[list[tuple[int, int]]] = []
        used: list[int] = []
        free: list[float] = []
        for i in items:
            for m in range(len(mbs)):
                if used[m] + tokens[i] <= token_budget and free[m] >= mem[i]:
                    mbs[m].append((i, layers))
                    used[m] += tokens[i]
                    free[m] -= mem[i]
                    break
            else:
                mbs.append([(i, layers)])
                used.append(tokens[i])
                free.append(table.budget_bytes - mem[i])
        g.micro_batches = mbs
    return work + idle


def greedy_draft(table: CostTable) -> Draft | None:
    """The Megatron Dynamic-CP style greedy draft (None if it cannot hold the batch)."""
    cm = table.cost_model
    cluster = cm.cluster
    n = cluster.num_gpus
    cls = table.classes.class_of
    pow2 = [d for d in table.sizes if d & (d - 1) == 0] or table.sizes
    per_token = float(cm.activation_bytes(1, group_size=1, recompute_layers=0))
    max_tokens_per_rank = max(1, math.floor(table.budget_bytes / per_token))
    tokens = [s.tokens for s in table.samples]
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    sizes: list[int] = []
    items: list[list[int]] = []
    heaps: dict[int, list[tuple[float, int]]] = {d: [] for d in pow2}  # (load, group) per size
    current_max = 0.0
    free = n
    for i in order:
        want = 1 << max(0, math.ceil(math.log2(max(1.0, tokens[i] / max_tokens_per_rank))))
        fitting = [d for d in pow2 if d >= want and table.k_min[cls[i], table.size_index(d)] >= 0]
        if not fitting:
            fitting = [d for d in pow2 if table.k_min[cls[i], table.size_index(d)] >= 0]
        best: tuple[float, float, int, int] | None = None  # (projected max, load, size, group)
        for d in fitting:
            t = float(table.time_s[cls[i], table.size_index(d)])
            if free >= d:
                cand = (max(current_max, t), t, d, -1)
                if best is None or cand < best:
                    best = cand
            if heaps[d]:
                load, g = heaps[d][0]
                cand = (max(current_max, load + t), load + t, d, g)
                if best is None or cand < best:
                    best = cand
        if best is None:
            return None
        _, new_load, d, g = best
        if g < 0:
            g = len(sizes)
            sizes.append(d)
            items.append([i])
            free -= d
        else:
            heapq.heappop(heaps[d])
            items[g].append(i)
        heapq.heappush(heaps[d], (new_load, g))
        current_max = max(current_max, new_load)
    filler = fill_ranks(free, table.sizes)
    if filler is None:
        return None
    placed = place_groups(sizes + filler, num_gpus=n, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    # Match working groups to placed blocks of the same size, in order.
    by_size: dict[int, list[int]] = {}
    for first_size, first in placed:
        by_size.setdefault(first_size, []).append(first)
    draft: Draft = []
    for d, members in zip(sizes, items, strict=True):
        j = table.size_index(d)
        ks = [int(table.k_min[cls[i], j]) for i in members]
        mems = [float(table.mem_bytes[cls[i], j]) for i in members]
        draft.append(DraftGroup(size=d, first_rank=by_size[d].pop(0),
                                micro_batches=_first_fit(members, mems, table.budget_bytes, ks)))
    for d in filler:
        draft.append(DraftGroup(size=d, first_rank=by_size[d].pop(0)))
    return draft


def baseline_drafts(table: CostTable, *, group_size: int | None = None,
                    reference: Sample | None = None) -> dict[str, Draft]:
    """Every baseline draft that can hold the batch, by name."""
    out: dict[str, Draft] = {}
    try:
        d = group_size if group_size is not None else bucket_size(table, reference=reference)
    except ValueError:
        d = None
    if d is not None:
        bucket = bucket_draft(table, group_size=d)
        if bucket is not None:
            out["bucket"] = bucket
        packed = packed_draft(table, group_size=d)
        if packed is not None:
            out["packed"] = packed
    if 4 in table.sizes:
        sp4 = bucket_draft(table, group_size=4)
        if sp4 is not None:
            out["bucket_sp4"] = sp4
    greedy = greedy_draft(table)
    if greedy is not None:
        out["greedy"] = greedy
    return out
