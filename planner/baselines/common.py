"""Helpers shared by the baselines: shape buckets, fixed layouts, placement and packing.

Every baseline builds a ``Draft`` (``planner.assemble``) from the cost table, so it is costed
by the same cost model and checked by the same validator as the planner's own plans.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

from planner.assemble import DraftGroup
from planner.costs import CostTable
from planner.placement import fill_ranks, place_groups


def full_checkpoint_layers(num_layers: int) -> int:
    """Recompute count standing for "full checkpointing".

    Under the cost model recomputing all ``L`` layers is dominated by recomputing ``L - 1``
    (the last layer's activations are rematerialised anyway, ``CostModel.activation_bytes``):
    less time and less memory. The baselines that checkpoint fully use ``L - 1`` (0 for a
    one-layer model).
    """
    return max(num_layers - 1, 0)


_BUCKETS: weakref.WeakKeyDictionary[CostTable, list[list[int]]] = weakref.WeakKeyDictionary()
"""``shape_buckets`` per live cost table (the batch's samples do not change)."""


def shape_buckets(table: CostTable) -> list[list[int]]:
    """The batch's samples grouped by shape bucket, buckets in order of first appearance.

    2D samples: one bucket per shape (frames x height x width), as the video workloads draw
    them. 1D samples: one bucket per power-of-two length range ``(2^(b-1), 2^b]``, as a
    length-bucketing sampler groups them.
    """
    cached = _BUCKETS.get(table)
    if cached is not None:  # four bucket-sp sizes and dcp-greedy ask for the same table's
        return [list(b) for b in cached]
    index: dict[tuple[int, ...], int] = {}
    buckets: list[list[int]] = []
    # A class is one (frames, tokens per frame) shape, so its 1D key (and its 2D key) is computed
    # once per class; whether a sample is 2D is its own (a one-frame clip shares a 1D class).
    c = table.classes
    key_1d = [(1, max(0, math.ceil(math.log2(int(t))))) for t in c.tokens.tolist()]
    key_2d = [(0, int(f), int(sp), int(t)) for f, sp, t in
              zip(c.frames.tolist(), c.spatial.tolist(), c.tokens.tolist(), strict=True)]
    is_2d = [s.frames is not None for s in table.samples]
    if not any(is_2d):  # per class: classes are numbered in order of first appearance
        class_bucket: list[int] = []
        for one_d in key_1d:
            class_bucket.append(index.setdefault(one_d, len(index)))
        buckets = [[] for _ in index]
        for i, cl in enumerate(c.class_of):
            buckets[class_bucket[cl]].append(i)
    else:
        for i, (cl, two_d) in enumerate(zip(c.class_of, is_2d, strict=True)):
            key: tuple[int, ...] = key_2d[cl] if two_d else key_1d[cl]
            b = index.get(key)
            if b is None:
                b = len(buckets)
                index[key] = b
                buckets.append([])
            buckets[b].append(i)
    _BUCKETS[table] = buckets
    return [list(b) for b in buckets]


def place_layout(sizes: Sequence[int], table: CostTable) -> list[DraftGroup] | None:
    """Groups of the given working sizes, placed with idle groups on the ranks left over.

    Returns:
        The working groups first, in the order of ``sizes`` (matched to placed blocks of equal
        size in rank order), then the idle filler groups; None when the sizes exceed the
        world or cannot be placed.
    """
    cluster = table.cost_model.cluster
    n = cluster.num_gpus
    free = n - sum(sizes)
    filler = fill_ranks(free, table.sizes) if free >= 0 else None
    if filler is None:
        return None
    placed = place_groups([*sizes, *filler], num_gpus=n, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    by_size: dict[int, list[int]] = {}
    for size, first in placed:
        by_size.setdefault(size, []).append(first)
    work = [DraftGroup(size=d, first_rank=by_size[d].pop(0)) for d in sizes]
    idle = [DraftGroup(size=d, first_rank=by_size[d].pop(0)) for d in filler]
    return work + idle


def fixed_layout(table: CostTable, group_size: int) -> list[DraftGroup] | None:
    """``N // group_size`` working groups of one size, then idle filler groups (or None)."""
    n = table.cost_model.cluster.num_gpus
    if group_size not in table.sizes or n // group_size == 0:
        return None
    return place_layout([group_size] * (n // group_size), table)


def first_fit(items: Sequence[int], mem_bytes: Sequence[float], budget_bytes: float,
              policies: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Micro-batches of ``(sample, recompute layers)``: each item into the first micro-batch
    with room for its bytes, in the order given (a new micro-batch when none has room)."""
    mbs: list[list[tuple[int, int]]] = []
    free: list[float] = []
    for i, m, k in zip(items, mem_bytes, policies, strict=True):
        for pos, room in enumerate(free):
            if room >= m:
                mbs[pos].append((i, k))
                free[pos] -= m
                break
        else:
            mbs.append([(i, k)])
            free.append(budget_bytes - m)
    return mbs


def pack_cheapest(table: CostTable, group: DraftGroup, members: Sequence[int]) -> bool:
    """Pack a group's samples first-fit decreasing (by bytes) at their cheapest fitting policy.

    Returns:
        False when a sample does not fit the group's size at all.
    """
    j = table.size_index(group.size)
    cls = table.classes.class_of
    mem, kmin = table.column(j)[5], table.column(j)[6]  # lists: no numpy scalar per sample
    if any(kmin[cls[i]] < 0 for i in members):
        return False
    order = sorted(members, key=lambda i: (-mem[cls[i]], i))
    group.micro_batches = first_fit(order, [mem[cls[i]] for i in order], table.budget_bytes,
                                    [int(kmin[cls[i]]) for i in order])
    return True

