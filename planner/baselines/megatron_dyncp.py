"""``megatron-dyncp``: Megatron-Core's dynamic context-parallel scheduler (docs/planner.md).

The rules, as Megatron documents them:

* ``max_tokens_per_rank`` (``--max-seqlen-per-dp-cp-rank``) is set to what a rank holds
  without recomputation: activation budget / bytes per token at policy 0.
* Each sample's CP size is the next power of two of ``tokens / max_tokens_per_rank`` (at least
  the smallest power-of-two size on which it fits at all; the largest allowed when it needs
  more, with the cheapest policy that fits).
* The first micro-batch: longest first, each sample goes to the least-loaded existing group of
  its size or to a new group from the free ranks, whichever gives the lower projected load; a
  group takes at most ``size * max_tokens_per_rank`` tokens, and joining an existing group is
  allowed only while its projected load stays within ``LOAD_CAP`` (5%) of the most loaded
  group. Ranks still free afterwards are filled by doubling groups.
* Samples left over go to further micro-batches: each to the least-loaded group (seconds so
  far) at least as large as its CP size.

Adaptations, so that the result is a plan of this project's schema (one group layout per step,
costed by the cost model): the layout of the first micro-batch is kept for the whole step
(Megatron may regroup per micro-batch); loads are the cost model's seconds per sample at its
cheapest fitting policy, not Megatron's ``s^2 / cp`` proxy (a stronger baseline, never a
weaker one); free ranks double the most loaded group (Megatron-Core 0.16.1's code doubles the
first group of the smallest size); each group's samples are packed first-fit decreasing by bytes
into micro-batches. The one layout is Megatron's first micro-batch's when that leaves no rank free
(tests/planner/test_megatron_parity.py); it can make a step slower than Megatron's regrouping
where the longest sample takes every rank (bench/megatron_parity.py).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import numpy as np

from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.common import pack_cheapest, place_layout
from planner.costs import CostTable

LOAD_CAP = 0.05
"""Relative slack over the most loaded group up to which a group may take another sample."""


def max_tokens_per_rank(table: CostTable) -> int:
    """Tokens a rank holds without recomputation under the activation budget (at least 1): the
    budget over the bytes each more token keeps (a joint-attention model's per-sample text bytes,
    ``CostModel.activation_bytes``, are not per token)."""
    cm = table.cost_model
    per_token = float(cm.activation_bytes(2, group_size=1, recompute_layers=0)
                      - cm.activation_bytes(1, group_size=1, recompute_layers=0))
    return max(1, math.floor(table.budget_bytes / per_token))


def cp_size(table: CostTable, i: int, *, tokens_per_rank: int) -> int | None:
    """CP size of sample ``i``: the next power of two of ``tokens / tokens_per_rank``, raised to
    the smallest power-of-two size it fits on, capped at the largest (None: fits none)."""
    return _CpSizes(table, tokens_per_rank)(i)


class _CpSizes:
    """``cp_size`` for the samples of one table, the power-of-two sizes each class fits on
    computed once per class."""

    def __init__(self, table: CostTable, tokens_per_rank: int) -> None:
        self._table, self._tpr = table, tokens_per_rank
        self._sizes = [d for d in table.sizes if d & (d - 1) == 0]
        # Per class, whether it fits each power-of-two size (k_min >= 0): one row per class.
        kmin = np.asarray(table.k_min)[:, [table.size_index(d) for d in self._sizes]]
        self._fits: list[list[bool]] = (kmin >= 0).tolist()
        self._fitting: dict[int, list[int]] = {}

    def __call__(self, i: int) -> int | None:
        table = self._table
        c = table.classes.class_of[i]
        fitting = self._fitting.get(c)
        if fitting is None:
            fitting = self._fitting[c] = list(itertools.compress(self._sizes, self._fits[c]))
        if not fitting:
            return None
        tokens = table.samples[i].tokens
        want = 1 << max(0, math.ceil(math.log2(max(1.0, tokens / self._tpr))))
        for d in fitting:
            if d >= want:
                return d
        return fitting[-1]


def megatron_dyncp_draft(table: CostTable, *, seed: int = 0,
                         reference: Sample | None = None) -> Draft | None:
    """The Megatron dynamic-CP draft (None when a sample fits no power-of-two size).

    Args:
        table: The batch's cost table.
        seed: Unused (the scheduler is deterministic); the registry's signature.
        reference: Unused (the registry's signature).
    """
    del seed, reference
    n = table.cost_model.cluster.num_gpus
    cls = table.classes.class_of
    tpr = max_tokens_per_rank(table)
    # Every sample's tokens through its class (one gather, not 131,072 pydantic field reads).
    sample_tokens = table.classes.tokens[table.classes.class_of]
    tokens: list[int] = sample_tokens.astype(np.int64).tolist()
    need: list[int] = []
    known: dict[tuple[int, int], int | None] = {}  # (class, tokens) -> CP size
    sizer = _CpSizes(table, tpr)
    for i in range(len(tokens)):
        key = (cls[i], tokens[i])
        if key not in known:
            known[key] = sizer(i)
        d = known[key]
        if d is None:
            return None
        need.append(d)

    time_rows = table.rows()[0]
    col_of = {d: table.size_index(d) for d in table.sizes}

    def time_s(i: int, d: int) -> float:
        return time_rows[cls[i]][col_of[d]]

    sizes: list[int] = []
    loads: list[float] = []
    held: list[int] = []  # tokens of the first micro-batch per group
    members: list[list[int]] = []
    leftovers: list[int] = []
    free = n
    top = 0.0
    # Groups of each size sorted by (load, index): the least loaded with room for the sample
    # is the one of least projected load (ties: the lower index).
    of_size: dict[int, list[tuple[float, int]]] = {}
    # Per size, at least the most tokens any of its groups has room for (exact after a scan that
    # found none with room): a longer sample skips the scan, which finds no room for it.
    max_room: dict[int, float] = {}
    for i in np.argsort(-sample_tokens, kind="stable").tolist():  # longest first, ties by index
        d, t = need[i], time_s(i, need[i])
        best: tuple[float, int] | None = None  # (projected load, group or -1 for a new one)
        if free >= d:
            best = (t, -1)
        if tokens[i] <= max_room.get(d, math.inf):
            cap = (1 + LOAD_CAP) * top
            most_room = -math.inf
            for load_g, g in of_size.get(d, []):
                projected = load_g + t
                if projected > cap:
                    break  # this group and the later ones (no less loaded) are over the cap
                if held[g] + tokens[i] > d * tpr:
                    most_room = max(most_room, d * tpr - held[g])
                    continue
                if best is None or projected < best[0]:
                    best = (projected, g)
                break
            else:  # every group scanned, none with room for this sample
                if d in max_room:
                    max_room[d] = most_room
        if best is None:
            leftovers.append(i)
            continue
        g = best[1]
        lst = of_size.setdefault(d, [])
        if g < 0:
            sizes.append(d)
            loads.append(0.0)
            held.append(0)
            members.append([])
            free -= d
            g = len(sizes) - 1
        else:
            del lst[bisect.bisect_left(lst, (loads[g], g))]
        loads[g] += t
        held[g] += tokens[i]
        members[g].append(i)
        if len(members[g]) == 1:  # a new group: its room may exceed the others'
            max_room[d] = max(max_room.get(d, -math.inf), d * tpr - held[g])
        bisect.insort(lst, (loads[g], g))
        top = max(top, loads[g])
    while True:  # fill free ranks by doubling the most loaded groups
        can = []
        for g, d in enumerate(sizes):
            if d <= free and 2 * d in table.sizes:
                kmin_2d = table.column(table.size_index(2 * d))[6]  # a list of k_min by class
                if all(kmin_2d[cls[i]] >= 0 for i in members[g]):
                    can.append(g)
        if not can:
            break
        g = max(can, key=lambda g: (loads[g], -g))
        free -= sizes[g]
        sizes[g] *= 2
        loads[g] = sum(time_s(i, sizes[g]) for i in members[g])
    # Leftovers, already longest first, each to the group where it finishes first (ties: the
    # lower index); groups of one size differ only by load, so a heap per size.
    heaps: dict[int, list[tuple[float, int]]] = {}
    for g, d in enumerate(sizes):
        heaps.setdefault(d, []).append((loads[g], g))
    for heap in heaps.values():
        heapq.heapify(heap)
    # (size, heap, size column) in the heaps' order; the loop below is time_s and the
    # (finish, group) tuple comparison inlined (most samples of a long-tailed batch are leftovers).
    by_size = [(d, heap, col_of[d]) for d, heap in heaps.items()]
    for i in leftovers:
        row, need_i = time_rows[cls[i]], need[i]
        finish, g, d = math.inf, -1, -1  # the best (finish, group), and the group's size
        for d_h, heap, j in by_size:
            if d_h >= need_i:
                load_h, g_h = heap[0]
                f = load_h + row[j]
                if g < 0 or f < finish or (f == finish and g_h < g):
                    finish, g, d = f, g_h, d_h
        assert g >= 0  # every leftover's size exists (it was opened for a longer one)
        loads[g] = finish
        members[g].append(i)
        heapq.heapreplace(heaps[d], (finish, g))
    groups = place_layout(sizes, table)
    if groups is None:
        return None
    for g in range(len(sizes)):
        if not pack_cheapest(table, groups[g], members[g]):
            return None
    return groups
