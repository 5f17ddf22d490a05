"""Resize moves: change the multiset of group sizes around a local-search optimum.

The local search (``local_search``) moves samples between *fixed* groups. A resize move
splits one group of size ``2d`` into two groups of size ``d``, or merges two groups of size
``d`` into one of size ``2d``; the samples of the groups it removes are re-placed, largest
first, on the group (of all groups) where each finishes earliest, then the local search
polishes the result. The move is kept only when it lowers the makespan. Candidates, per
round: for every size, a split of its least loaded group, a merge of its two least loaded
groups, then (after those of every size) a merge of its least loaded group with smaller
groups making up the same size; the best improving one is kept, and rounds repeat while one improves.

``lone_merge`` is the one resize move every preset runs: when the slowest group holds a single
sample, no move of other samples can lower the makespan, only a larger group for that sample
(a long-tail batch's longest sample on its most efficient size can outlast every other group).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import numpy as np

from planner.costs import CostTable
from planner.placement import place_groups
from planner.search.group_state import GroupState, insert_sample, repack
from planner.search.local_search import local_search


def _makespan(groups: list[GroupState]) -> float:
    return max(g.load_s for g in groups)


def _replaced(table: CostTable, groups: list[GroupState], remove: list[int], add: list[int]
              ) -> list[GroupState] | None:
    """Groups with ``remove`` (indices) dropped and empty groups of sizes ``add`` added, the
    dropped samples re-placed earliest-finish-first; None if the sizes cannot be placed or a
    sample fits nowhere."""
    cluster = table.cost_model.cluster
    kept = [GroupState(size=g.size, col=g.col, first_rank=g.first_rank, load_s=g.load_s,
                       mbs=[list(mb) for mb in g.mbs], free_bytes=list(g.free_bytes))
            for k, g in enumerate(groups) if k not in remove]
    multiset = [g.size for g in kept] + add
    placed = place_groups(multiset, num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    new = kept + [GroupState(size=d, col=table.size_index(d), first_rank=-1) for d in add]
    # Ranks: the placement's slots of each size, in rank order, to the groups of that size in
    # list order (times in the table assume aligned contiguous placement, as for the LPT).
    slots: dict[int, list[int]] = {}
    for d, r in placed:
        slots.setdefault(d, []).append(r)
    for g in new:
        g.first_rank = slots[g.size].pop(0)
    cls = table.classes.class_of
    sizes = np.asarray(table.sizes, dtype=np.float64)
    area = np.min(table.time_s * sizes[None, :], axis=1)
    loose = sorted((i for k in remove for mb in groups[k].mbs for i in mb),
                   key=lambda i: (-area[cls[i]], i))
    o = table.overhead_s
    for i in loose:
        c = cls[i]
        best, best_f = -1, np.inf
        for k, g in enumerate(new):
            t = table.time_s[c, g.col]
            if t == np.inf:
                continue
            f = g.load_s + t + (o if max(g.free_bytes, default=-1.0) < table.mem_bytes[c, g.col]
                                else 0.0)
            if f < best_f:
                best, best_f = k, f
        if best < 0:
            return None
        insert_sample(table, new[best], i)
        new[best].load_s = best_f
    new.sort(key=lambda g: g.first_rank)
    return new


def _candidates(table: CostTable, groups: list[GroupState]) -> list[tuple[list[int], list[int]]]:
    """(groups to remove, sizes to add) for every split and merge candidate, in a fixed order."""
    allowed = set(table.sizes)
    out: list[tuple[list[int], list[int]]] = []
    extra: list[tuple[list[int], list[int]]] = []  # tried after every plain split and merge
    for d in sorted({g.size for g in groups}, reverse=True):
        same = sorted((k for k, g in enumerate(groups) if g.size == d),
                      key=lambda k: (groups[k].load_s, k))
        if d % 2 == 0 and d // 2 in allowed:
            out.append(([same[0]], [d // 2, d // 2]))
        if 2 * d in allowed:
            if len(same) >= 2:
                out.append((same[:2], [2 * d]))
            # The least loaded group of size d with smaller groups making up another d (two
            # steps of merges whose first alone would not improve).
            taken = _with_smaller(groups, same[0], key=lambda k: (-groups[k].size, groups[k].load_s, k))
            if taken is not None:
                extra.append((taken, [2 * d]))
    return out + extra


def resize_search(table: CostTable, groups: list[GroupState], *, max_tries: int, max_moves: int,
                  max_ejections: int) -> list[GroupState]:
    """The groups after improving split and merge moves (``max_tries`` candidates in all).

    Args:
        table: Costs of the batch.
        groups: A local-search optimum (not modified).
        max_tries: Most candidate moves evaluated (each one re-placement and local search).
        max_moves: Local-search moves per candidate.
        max_ejections: Local-search ejections per candidate.

    Returns:
        The best groups found (``groups`` itself when no move improves).
    """
    best = groups
    best_time = _makespan(groups)
    tries = 0
    while tries < max_tries:
        pulled = itertools.count()
        moves = ((next(pulled), move)[1] for move in itertools.islice(_candidates(table, best), max_tries - tries))
        round_best = _best_move(table, best, moves, best_time, max_moves=max_moves, max_ejections=max_ejections)
        tries += next(pulled)
        if round_best is None:
            break
        best_time, best = round_best
    return best


def _best_move(table: CostTable, groups: list[GroupState], moves: Iterable[tuple[list[int], list[int]]],
               best_time: float, *, max_moves: int, max_ejections: int
               ) -> tuple[float, list[GroupState]] | None:
    """The fastest of ``moves`` (groups removed, sizes added; each re-placed, local-searched and
    repacked) whose makespan is below ``best_time``, with that makespan; None when none is."""
    found: tuple[float, list[GroupState]] | None = None
    for remove, add in moves:
        trial = _replaced(table, groups, remove, add)
        if trial is None:
            continue
        local_search(table, trial, max_moves=max_moves, max_ejections=max_ejections)
        for g in trial:
            repack(table, g)
        t = _makespan(trial)
        if t < best_time * (1 - 1e-9) and (found is None or t < found[0]):
            found = (t, trial)
    return found


def _lone_merges(table: CostTable, groups: list[GroupState], slow: int) -> list[tuple[list[int], list[int]]]:
    """Merges of the slowest group (size ``d``) into one of ``2d``: with the least loaded other
    group of size ``d``, and with the least loaded smaller groups making up ``d``."""
    d = groups[slow].size
    if 2 * d not in set(table.sizes):
        return []
    out: list[tuple[list[int], list[int]]] = []
    same = sorted((k for k, g in enumerate(groups) if g.size == d and k != slow), key=lambda k: (groups[k].load_s, k))
    if same:
        out.append((sorted([slow, same[0]]), [2 * d]))
    taken = _with_smaller(groups, slow, key=lambda k: (groups[k].load_s, -groups[k].size, k))
    if taken is not None:
        out.append((taken, [2 * d]))
    return out


def _with_smaller(groups: list[GroupState], first: int, *, key: Callable[[int], tuple[float, ...]]
                  ) -> list[int] | None:
    """Group ``first`` (size ``d``) with smaller groups, taken greedily in ``key`` order where
    they still fit, that add up to ``d`` (sorted indices); None when none do."""
    rest, taken = groups[first].size, [first]
    for k in sorted((k for k, g in enumerate(groups) if g.size < groups[first].size), key=key):
        if groups[k].size <= rest:
            taken.append(k)
            rest -= groups[k].size
            if rest == 0:
                return sorted(taken)
    return None


def lone_merge(table: CostTable, groups: list[GroupState], *, max_moves: int, max_ejections: int
               ) -> list[GroupState]:
    """The groups after merging the slowest group into one of twice its size, while it holds a
    single sample and the merge (re-placement and local search, as ``resize_search``) lowers the
    makespan; ``groups`` itself when it does not."""
    best, best_time = groups, _makespan(groups)
    while True:
        slow = max(range(len(best)), key=lambda k: (best[k].load_s, -k))
        if sum(len(mb) for mb in best[slow].mbs) != 1:
            return best
        improved = _best_move(table, best, _lone_merges(table, best, slow), best_time, max_moves=max_moves,
                              max_ejections=max_ejections)
        if improved is None:
            return best
        best_time, best = improved
