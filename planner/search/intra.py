"""DCP-intra: checkpoint policies chosen per micro-batch, jointly with the micro-batch split.

Samples in one micro-batch share one rank's memory, so the choice is not per sample: a
micro-batch whose samples need ``E`` bytes more than the budget at ``k = 0`` must recompute
layers worth ``E`` bytes, and it may take them from whichever samples recompute most cheaply.
On size column ``j`` a sample at policy ``k`` (``0 <= k <= L - 1``) costs, exactly under the
cost model (``planner.costs.CostTable``):

    time(k)  = time0 + k * r      r: seconds of recomputing one layer
    bytes(k) = mem0  - k * b      b: bytes one recomputed layer saves

and a micro-batch adds a fixed time ``base + (L + max k - min k) * call + max k * call_fwd``
(``CostModel.microbatch_fixed_s``: mixing policies splits layer calls, recompute adds forward
calls). For one micro-batch the choice is a knapsack with ``L - 1`` identical units per sample
(cover ``E`` bytes at least recompute time): filling the samples of least ``r / b`` first (the
activations kept are those that save most time per byte) is optimal but for the last, partly
used sample; the cap on ``max k`` (a few values) and a uniform policy trade the fixed calls
against it. Across micro-batches: from the first-fit-decreasing split at ``k_min`` (each sample's
cheapest policy alone) down to fewer micro-batches, each split balancing bytes, while the
total falls: one micro-batch fewer saves its fixed time and costs recompute.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Sequence

from planner.assemble import Draft, DraftGroup
from planner.costs import CostTable

Layout = list[list[tuple[int, int]]]
"""Micro-batches of ``(sample index, recompute layers)``."""

_MEM_SLACK = 1e-9
"""Relative slack kept below the budget against floating-point summation order."""


def kmin_layout(table: CostTable, j: int, members: Sequence[int]) -> Layout:
    """First-fit decreasing by bytes with every sample at its ``k_min`` (inter-only policies)."""
    cls = table.classes.class_of
    mem = table.column(j)[5]
    kmin = table.column(j)[6]
    order = sorted(members, key=lambda i: (-mem[cls[i]], i))
    mbs: Layout = []
    free: list[float] = []
    for i in order:
        m = mem[cls[i]]
        for pos, f in enumerate(free):
            if f >= m:
                mbs[pos].append((i, int(kmin[cls[i]])))
                free[pos] -= m
                break
        else:
            mbs.append([(i, int(kmin[cls[i]]))])
            free.append(table.budget_bytes - m)
    return mbs


def layout_time_s(table: CostTable, j: int, layout: Layout) -> float:
    """Time of a group's micro-batches under the search's cost rows (aligned placement)."""
    return _layout_time_s(_column(table, j), layout)


def _layout_time_s(col: _Column, layout: Layout) -> float:
    cls, t0, r = col.cls, col.t0, col.r
    total = 0.0
    for mb in layout:
        if mb:
            ks = [k for _, k in mb]
            total += col.fixed_s(max(ks), min(ks))
            total += sum([t0[cls[i]] + k * r[cls[i]] for i, k in mb])
    return total


def microbatch_policies(table: CostTable, j: int, members: Sequence[int]
                        ) -> tuple[float, list[tuple[int, int]]] | None:
    """Cheapest policies for samples sharing one micro-batch: ``(time_s, [(i, k)])`` or None.

    None when the samples cannot fit together even with ``L - 1`` layers recomputed each.
    The result depends on ``members`` in their order (sums run in it), and the layouts of one
    batch re-price the same micro-batches many times: memoised per table on the sequence.
    """
    return _policies(_column(table, j), members)


def _policies(col: _Column, members: Sequence[int]) -> tuple[float, list[tuple[int, int]]] | None:
    """``microbatch_policies`` on a column (memoised in it)."""
    if len(members) == 1:  # a sample alone: the result depends on its class only
        i = members[0]
        c = col.cls[i]
        single = col.single
        if c in single:
            alone = single[c]
        else:
            res = _microbatch_policies(col, members)
            alone = single[c] = None if res is None else (res[0], res[1][0][1])
        return None if alone is None else (alone[0], [(i, alone[1])])
    key = tuple(members)
    memo = col.memo
    if key in memo:
        hit = memo[key]
    else:
        hit = memo[key] = _microbatch_policies(col, members)
    return None if hit is None else (hit[0], list(hit[1]))


class _Column:
    """What ``microbatch_policies`` reads of one size column, and its results so far."""

    __slots__ = ("b", "base_fixed_s", "budget", "call_fwd_s", "call_s", "cls", "fixed0_s",
                 "layers", "m0", "memo", "r", "single", "t0", "top")

    def __init__(self, table: CostTable, j: int) -> None:
        self.cls = table.classes.class_of
        self.t0, self.r, self.m0, self.b = table.column(j)[:4]
        self.layers = table.num_layers
        self.top = table.num_layers - 1
        self.budget = table.budget_bytes * (1 - _MEM_SLACK)
        self.base_fixed_s = table.microbatch_base_s
        self.call_s = float(table.call_s_by_size[j])
        self.call_fwd_s = float(table.call_fwd_s_by_size[j])
        self.fixed0_s = self.fixed_s(0, 0)
        self.memo: dict[tuple[int, ...], tuple[float, list[tuple[int, int]]] | None] = {}
        self.single: dict[int, tuple[float, int] | None] = {}  # by class: (seconds, policy)

    def fixed_s(self, hi: int, lo: int) -> float:
        """Fixed seconds of a micro-batch whose policies run from ``lo`` to ``hi`` recomputed
        layers (``CostModel.microbatch_fixed_s``: mixed policies split layer calls, recompute
        adds forwards)."""
        return self.base_fixed_s + (self.layers + hi - lo) * self.call_s + hi * self.call_fwd_s


_COLUMNS: weakref.WeakKeyDictionary[CostTable, dict[int, _Column]] = weakref.WeakKeyDictionary()
"""``microbatch_policies``'s columns (and memo) per live cost table."""


def _column(table: CostTable, j: int) -> _Column:
    columns = _COLUMNS.get(table)
    if columns is None:
        columns = _COLUMNS[table] = {}
    col = columns.get(j)
    if col is None:
        col = columns[j] = _Column(table, j)
    return col


def _microbatch_policies(col: _Column, members: Sequence[int]
                         ) -> tuple[float, list[tuple[int, int]]] | None:
    cls, m0, t0 = col.cls, col.m0, col.t0
    cs = [cls[i] for i in members]
    excess = sum([m0[c] for c in cs]) - col.budget
    base_s = sum([t0[c] for c in cs])
    if excess <= 0:
        return base_s + col.fixed0_s, [(i, 0) for i in members]
    top = col.top
    if top <= 0:
        return None
    r, b = col.r, col.b
    # Recompute first where one layer's recompute buys the most bytes per second.
    order = sorted([(r[c] / b[c], i, c) for i, c in zip(members, cs, strict=True)
                    if b[c] > 0])
    total_b = sum([b[c] for _, _, c in order])
    if total_b * top < excess:
        return None
    best: tuple[float, list[tuple[int, int]]] | None = None
    k_uniform = math.ceil(excess / total_b)
    caps = sorted({top, max(k_uniform, (top + 1) // 2), max(k_uniform, (top + 3) // 4)},
                  reverse=True)
    ceil = math.ceil
    for cap in caps:
        ks: dict[int, int] = {}
        left = excess
        extra_s = 0.0
        for _, i, c in order:
            bc = b[c]
            k = ceil(left / bc)
            if k > cap:
                k = cap
            ks[i] = k
            left -= k * bc
            extra_s += k * r[c]
            if left <= 0:
                break
        if left > 0:
            continue
        # fixed seconds of the policies [ks.get(i, 0) for i in members]: every k here is >= 1.
        hi = max(ks.values())
        lo = min(ks.values()) if len(ks) == len(members) else 0
        t = base_s + extra_s + col.fixed_s(hi, lo)
        if best is None or t < best[0]:
            best = (t, [(i, ks.get(i, 0)) for i in members])
    if k_uniform <= top and len(order) == len(members):
        t = base_s + k_uniform * sum([r[c] for c in cs]) + col.fixed_s(k_uniform, k_uniform)
        if best is None or t < best[0]:
            best = (t, [(i, k_uniform) for i in members])
    return best


def _balanced_split(col: _Column, members: Sequence[int], count: int) -> list[list[int]]:
    """``count`` micro-batches: ``members`` (largest ``k = 0`` bytes first) each into the one
    holding fewest bytes."""
    cls, m0 = col.cls, col.m0
    heap = [(0.0, pos) for pos in range(count)]
    out: list[list[int]] = [[] for _ in range(count)]
    for i in members:
        load, pos = heapq.heappop(heap)
        out[pos].append(i)
        heapq.heappush(heap, (load + m0[cls[i]], pos))
    return out


def intra_layout(table: CostTable, j: int, members: Sequence[int]) -> tuple[float, Layout]:
    """Micro-batch split and per-sample policies of one group: ``(time_s, layout)``.

    Candidates: the first-fit-decreasing split at ``k_min``, re-optimised per micro-batch, then
    balanced splits into one micro-batch fewer at a time while the total time falls (or until
    the samples no longer fit). The cheapest is returned.
    """
    if not members:
        return 0.0, []
    # The result depends on the set of members only (every order below is a sort with index
    # ties), and the search prices the same group many times: memoised per table.
    memo = _LAYOUTS.setdefault(table, {})
    key = (j, tuple(sorted(members)))
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _intra_layout(table, j, members)
    return hit[0], [list(mb) for mb in hit[1]]


_LAYOUTS: weakref.WeakKeyDictionary[CostTable, dict[tuple[int, tuple[int, ...]],
                                                     tuple[float, Layout]]] = (
    weakref.WeakKeyDictionary())
"""``intra_layout`` results per live cost table."""


def _intra_layout(table: CostTable, j: int, members: Sequence[int]) -> tuple[float, Layout]:
    col = _column(table, j)
    base = kmin_layout(table, j, members)
    best_s, best = _layout_time_s(col, base), base
    # The k_min split with its policies re-chosen per micro-batch (kept when cheaper).
    refit: Layout = []
    refit_s = 0.0
    for kmin_mb in base:
        res = _policies(col, [i for i, _ in kmin_mb])
        if res is None:
            refit = []
            break
        refit_s += res[0]
        if refit_s >= best_s:  # times are non-negative: the full sum would not be cheaper
            refit = []
            break
        refit.append(res[1])
    if refit and refit_s < best_s:
        best_s, best = refit_s, refit
    previous = best_s
    cls, m0 = col.cls, col.m0
    by_bytes = sorted(members, key=lambda i: (-m0[cls[i]], i))
    for count in range(len(base) - 1, 0, -1):
        split = _balanced_split(col, by_bytes, count)
        total = 0.0
        layout: Layout = []
        for mb in split:
            res = _policies(col, mb)
            if res is None:
                total = math.inf
                break
            total += res[0]
            if total >= previous:  # non-negative times: this count ends the descent anyway
                break
            layout.append(res[1])
        if total < best_s:
            best_s, best = total, layout
        if total >= previous:
            break
        previous = total
    return best_s, best


def intra_draft(table: CostTable, draft: Draft) -> Draft:
    """A draft with each group's split and policies re-chosen (``intra_layout``) where that is
    faster under the search's cost rows; groups and their samples unchanged."""
    out: Draft = []
    for g in draft:
        j = table.size_index(g.size)
        current = layout_time_s(table, j, g.micro_batches)
        t, layout = intra_layout(table, j, [i for mb in g.micro_batches for i, _ in mb])
        mbs = [sorted(mb) for mb in layout] if t < current else g.micro_batches
        out.append(DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=mbs))
    return out
