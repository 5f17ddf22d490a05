"""Candidate multisets of group sizes for the heuristic.

* ``candidate_multisets``: for a few target makespans ``T`` around the lower bound, each sample
  class picks its most efficient size that meets ``T`` (as in the deadline-area bound); the work
  per size becomes a number of groups, rounded two ways and repaired to sum to ``N``; uniform
  multisets (all groups of one size) follow.
* ``packed_multiset``: the groups one target makespan calls for, by bin packing whole samples
  with groups opened on demand.
"""

from __future__ import annotations

import bisect
import math
import weakref

import numpy as np

from planner.costs import CostTable
from planner.placement import fill_ranks, place_groups
from planner.search.lpt import SCAN

_EPS = 1e-12


def candidate_multisets(table: CostTable, *, makespan_s: float, limit: int) -> list[list[int]]:
    """Group-size multisets (descending) that partition the world and can hold every sample."""
    n = table.cost_model.cluster.num_gpus
    sizes = table.sizes
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    o = table.overhead_s
    area = table.time_s * np.asarray(sizes, dtype=np.float64)[None, :]
    # The largest of the classes' smallest fitting sizes (0 for a class that fits none).
    fits = table.k_min >= 0
    required = int(np.where(fits.any(axis=1), np.asarray(sizes)[fits.argmax(axis=1)], 0).max())
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()

    def add(multiset: list[int] | None) -> None:
        if multiset is None or sum(multiset) != n:
            return
        key = tuple(sorted(multiset, reverse=True))
        if key in seen or key[0] < required:
            return
        if place_groups(key, num_gpus=n, gpus_per_node=table.cost_model.cluster.gpus_per_node
                        ) is None:
            return
        seen.add(key)
        out.append(list(key))

    # Sizes along the first axis (size x class): a reduction over sizes then runs over whole
    # rows, several times faster than along the short last axis (the same first minimum).
    time_t = np.ascontiguousarray(table.time_s.T)
    area_t = np.ascontiguousarray(area.T)
    time_o_t = time_t + o
    rows = np.arange(len(counts))
    for factor in (1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.6, 2.0, 3.0):
        deadline = makespan_s * factor
        ok = time_o_t <= deadline * (1 + _EPS)
        choice = np.where(ok, area_t, np.inf).argmin(axis=0)
        keep = np.isfinite(area_t[choice, rows])
        # Each class's work added to its size in class order (np.add.at: unbuffered, in
        # order, the same sums as a loop over the classes).
        demand = np.zeros(len(sizes))
        np.add.at(demand, choice[keep], (counts * time_t[choice, rows])[keep])
        groups = demand / max(deadline - o, _EPS)
        ranks = groups * np.asarray(sizes, dtype=np.float64)
        if ranks.sum() <= 0:
            continue
        for scaled in (groups, groups * n / ranks.sum()):
            add(_round_groups(scaled, sizes, n, ceil_largest=True))
            add(_round_groups(scaled, sizes, n, ceil_largest=False))
        if len(out) >= limit:
            return out[:limit]
    for d in sorted(sizes, reverse=True):
        rest = fill_ranks(n % d, sizes)
        if rest is not None:
            add([d] * (n // d) + rest)
        if len(out) >= limit:
            break
    return out


def _round_groups(groups: np.ndarray, sizes: list[int], n: int, *, ceil_largest: bool
                  ) -> list[int] | None:
    """Integer groups per size from fractional ones, summing to ``n`` ranks.

    ``ceil_largest`` rounds up from the largest size down while ranks remain (the largest
    samples need their group even when their share of work is a fraction of one); otherwise
    sizes are rounded down and the largest remainders get the spare ranks.
    """
    # at most n groups of any size: a tiny deadline (or an extreme cost model) can ask for 1e300
    # (then plain lists: a handful of sizes, where numpy scalars cost most; the same floats).
    frac: list[float] = np.clip(np.nan_to_num(np.asarray(groups, dtype=np.float64), nan=0.0,
                                              posinf=n), 0.0, n).tolist()
    whole = [math.floor(g + 1e-9) for g in frac]
    if ceil_largest:
        used = 0
        for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
            want = math.ceil(frac[j] - 1e-9)
            take = min(want, (n - used) // sizes[j])
            whole[j] = take
            used += take * sizes[j]
    used = sum(w * d for w, d in zip(whole, sizes, strict=True))
    while used > n:  # can only happen through rounding noise
        j = next((j for j, w in enumerate(whole) if w > 0), 0)
        whole[j] -= 1
        used -= sizes[j]
    rest = [g - w for g, w in zip(frac, whole, strict=True)]
    for j in sorted(range(len(sizes)), key=lambda j: (-rest[j], -sizes[j])):
        if rest[j] > 1e-9 and used + sizes[j] <= n:
            whole[j] += 1
            used += sizes[j]
    multiset = [d for j, d in enumerate(sizes) for _ in range(whole[j])]
    filler = fill_ranks(n - used, sizes)
    if filler is None:
        return None
    return sorted(multiset + filler, reverse=True)


_AreaOrders = tuple[list[list[int]], dict[tuple[int, int], list[int]], np.ndarray, np.ndarray]


def _area_orders(table: CostTable) -> _AreaOrders:
    """Per class, the size columns by GPU-seconds (stable: ties by column); a memo of the
    columns of a class within a bit mask, in that order; time plus overhead and GPU-seconds
    as size x class arrays (reductions over sizes run over whole rows). Cached per live table.
    """
    cached = _AREA_ORDERS.get(table)
    if cached is None:
        area = table.time_s * np.asarray(table.sizes, dtype=np.float64)[None, :]
        cached = _AREA_ORDERS[table] = (
            np.argsort(area, axis=1, kind="stable").tolist(), {},
            np.ascontiguousarray((table.time_s + table.overhead_s).T),
            np.ascontiguousarray(area.T))
    return cached


_AREA_ORDERS: weakref.WeakKeyDictionary[CostTable, _AreaOrders] = weakref.WeakKeyDictionary()
"""``_area_orders`` per live cost table."""


def packed_multiset(table: CostTable, order: list[int], *, target_s: float,
                    fill_tolerance: float = 1.3, runs: list[int] | None = None
                    ) -> list[int] | None:
    """The groups a target makespan calls for: bin packing with groups opened on demand.

    Each sample (decreasing work) goes to the fullest open group of its most efficient size
    that meets the target, or opens one. The result accounts for whole samples (two samples
    that each need half the target on a group of 4 need two such groups), which the
    fractional demands of ``candidate_multisets`` do not. Returns the multiset, filled up to
    the world size with the smallest groups, or None if it needs more ranks than the world has
    or a sample cannot meet the target. ``runs``: end positions of runs of near-equal samples
    in ``order`` (``heuristic.bucket_runs``; default: runs of identical samples), placed in
    bulk with each sample at its exact cost.
    """
    cluster = table.cost_model.cluster
    n = cluster.num_gpus
    o, budget = table.overhead_s, table.budget_bytes
    orders, tolerated_memo, time_o_t, area_t = _area_orders(table)
    meets = time_o_t <= target_s  # size x class
    if not meets.any(axis=0).all():
        return None
    area = np.where(meets, area_t, np.inf)
    within = area <= area.min(axis=0)[None, :] * fill_tolerance
    # Each class's sizes within the tolerance as a bit mask (one int per class: the loop below
    # reads one entry per class, where numpy scalars and per-entry lists cost most).
    codes: list[int] = (within.astype(np.int64) << np.arange(len(table.sizes))[:, None]
                        ).sum(axis=0).tolist()
    cls = table.classes.class_of
    # Open groups per size column: loads and free bytes of the open micro-batch (arrays with
    # room for every group the world could hold), and how many are open.
    # Plain lists: a handful of open groups per size, where numpy's per-call cost dominates.
    loads: dict[int, list[float]] = {j: [0.0] * (n // d) for j, d in enumerate(table.sizes)}
    frees: dict[int, list[float]] = {j: [-1.0] * (n // d) for j, d in enumerate(table.sizes)}
    time_rows, mem_rows, _ = table.rows()
    # Open groups of each size sorted by load, as (load, group, free bytes of its open
    # micro-batch): the best fit is found by bisection, the scan reads the free bytes in place.
    by_load: dict[int, list[tuple[float, int, float]]] = {j: [] for j in range(len(table.sizes))}
    # Per size column, time and bytes by class (``CostTable.column``), fetched when first used:
    # a run's samples read them per sample.
    col_lists: list[tuple[list[float], ...] | None] = [None] * len(table.sizes)
    opened = dict.fromkeys(range(len(table.sizes)), 0)
    used = 0
    ocls = list(map(cls.__getitem__, order))  # class of each position
    if runs is None:
        runs = [end for end in range(1, len(order) + 1)
                if end == len(order) or ocls[end] != ocls[end - 1]]
    pos = 0
    for end in runs:
        while pos < end:
            c = ocls[pos]
            # Sizes to try: the most efficient that meets the target first (the first of the
            # class's sizes by GPU-seconds within the mask: sizes that miss the target are out
            # of it), then open groups of sizes within the tolerance (leftover time of a big
            # group is worth filling with mid-size samples).
            key = (c, codes[c])
            tolerated = tolerated_memo.get(key)
            if tolerated is None:
                tolerated = [j for j in orders[c] if key[1] >> j & 1]
                tolerated_memo[key] = tolerated
            jb = tolerated[0]
            # Fullest open group that still meets the target with one more copy.
            best_k, j = -1, jb
            for jj in tolerated:
                count = opened[jj]
                if not count:
                    continue
                t_c, m_c = time_rows[c][jj], mem_rows[c][jj]
                lst = by_load[jj]
                best_finish = -np.inf
                # The first of the latest finishes within the target, among the groups just
                # below the bisection point (a lower load cannot finish later).
                p = bisect.bisect_right(lst, (target_s - t_c, np.inf))
                for ld_k, k, fr_k in reversed(lst[p - SCAN if p > SCAN else 0:p]):
                    if ld_k + t_c + o < best_finish:
                        break
                    finish = ld_k + t_c + (o if fr_k < m_c else 0.0)
                    if finish <= target_s and (finish > best_finish
                                               or (finish == best_finish and k < best_k)):
                        best_finish, best_k = finish, k
                if best_k >= 0:
                    j = jj
                    break
            if best_k < 0:
                used += table.sizes[j]
                if used > n:
                    return None
                best_k = opened[j]
                opened[j] += 1
                bisect.insort(by_load[j], (0.0, best_k, -1.0))
            ld, fr = loads[j][best_k], frees[j][best_k]
            old = (ld, best_k, fr)
            cl = col_lists[j]
            if cl is None:
                cl = col_lists[j] = table.column(j)
            time_c, mem_c = cl[4], cl[5]
            first = True
            while pos < end:
                ci = ocls[pos]
                t, m = time_c[ci], mem_c[ci]
                opens = fr < m
                nxt = ld + t + (o if opens else 0.0)
                if not first and not nxt <= target_s:
                    break
                first = False
                fr = budget - m if opens else fr - m
                ld = nxt
                pos += 1
            loads[j][best_k], frees[j][best_k] = ld, fr
            lst = by_load[j]
            del lst[bisect.bisect_left(lst, old)]
            bisect.insort(lst, (ld, best_k, fr))
    filler = fill_ranks(n - used, table.sizes)
    if filler is None:
        return None
    multiset = [table.sizes[j] for j, count in opened.items() for _ in range(count)] + filler
    return sorted(multiset, reverse=True)
