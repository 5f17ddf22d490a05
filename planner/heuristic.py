"""The fast heuristic: candidate group-size multisets, LPT assignment, local search.

1. Candidate multisets of group sizes that partition the world: for a few target makespans
   ``T`` around the deadline-area bound, each sample class picks its most efficient size that
   meets ``T`` (as in the bound); the work per size becomes a number of groups, rounded by
   largest remainders and repaired to sum to ``N``. Uniform multisets (all groups one size)
   are added, so the search always contains the fixed-size plans.
2. LPT: samples in decreasing work order go to the group where they finish earliest; each group
   packs its samples first-fit into micro-batches under the memory cap, each sample at its
   cheapest fitting policy, and pays the micro-batch overhead per micro-batch it opens.
3. Local search on the best candidates: move or swap samples off the slowest group while that
   lowers the makespan, then repack each group first-fit-decreasing.

Everything is deterministic (sorted orders, index tie-breaks); limits are move counts.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

import numpy as np

from planner.assemble import Draft, DraftGroup
from planner.costs import CostTable
from planner.placement import fill_ranks, place_groups

logger = logging.getLogger(__name__)

_EPS = 1e-12


@dataclass(slots=True)
class _Group:
    """A group being filled: its micro-batches and their free memory."""

    size: int
    col: int
    first_rank: int
    load_s: float = 0.0
    mbs: list[list[int]] = field(default_factory=list)
    free_bytes: list[float] = field(default_factory=list)

    def room(self, mem: float) -> int:
        """Index of the first micro-batch with room for ``mem`` bytes, or -1."""
        for m, free in enumerate(self.free_bytes):
            if free >= mem:
                return m
        return -1


def candidate_multisets(table: CostTable, *, makespan_s: float, limit: int) -> list[list[int]]:
    """Group-size multisets (descending) that partition the world and can hold every sample."""
    n = table.cost_model.cluster.num_gpus
    sizes = table.sizes
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    o = table.overhead_s
    area = table.time_s * np.asarray(sizes, dtype=np.float64)[None, :]
    required = max((table.smallest_fitting_size(members[0]) or 0)
                   for members in table.classes.members)
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

    for factor in (1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.6, 2.0, 3.0):
        deadline = makespan_s * factor
        ok = table.time_s + o <= deadline * (1 + _EPS)
        choice = np.where(ok, area, np.inf).argmin(axis=1)
        demand = np.zeros(len(sizes))
        for c, j in enumerate(choice):
            if np.isfinite(area[c, j]):
                demand[j] += counts[c] * table.time_s[c, j]
        groups = demand / max(deadline - o, _EPS)
        ranks = groups * np.asarray(sizes, dtype=np.float64)
        if ranks.sum() <= 0:
            continue
        groups = groups * n / ranks.sum()
        add(_round_groups(groups, sizes, n))
        if len(out) >= limit:
            return out
    for d in sorted(sizes, reverse=True):
        rest = fill_ranks(n % d, sizes)
        if rest is not None:
            add([d] * (n // d) + rest)
        if len(out) >= limit:
            break
    return out


def _round_groups(groups: np.ndarray, sizes: list[int], n: int) -> list[int] | None:
    """Integer groups per size from fractional ones, summing to ``n`` ranks (largest first)."""
    whole = np.floor(groups + 1e-9).astype(int)
    used = int((whole * np.asarray(sizes)).sum())
    while used > n:  # can only happen through rounding noise
        j = int(np.argmax(whole > 0))
        whole[j] -= 1
        used -= sizes[j]
    rest = groups - whole
    for j in sorted(range(len(sizes)), key=lambda j: (-rest[j], -sizes[j])):
        if rest[j] > 1e-9 and used + sizes[j] <= n:
            whole[j] += 1
            used += sizes[j]
    multiset = [d for j, d in enumerate(sizes) for _ in range(int(whole[j]))]
    filler = fill_ranks(n - used, sizes)
    if filler is None:
        return None
    return sorted(multiset + filler, reverse=True)


def _order(table: CostTable) -> list[int]:
    """Samples by decreasing work (most efficient GPU-seconds), ties by index."""
    sizes = np.asarray(table.sizes, dtype=np.float64)
    work = np.min(table.time_s * sizes[None, :], axis=1)
    cls = table.classes.class_of
    return sorted(range(len(cls)), key=lambda i: (-work[cls[i]], i))


def lpt(table: CostTable, multiset: list[int], order: list[int]) -> list[_Group] | None:
    """Assign samples to the groups of a multiset, earliest finish first."""
    cluster = table.cost_model.cluster
    placed = place_groups(multiset, num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    groups = [_Group(size=d, col=table.size_index(d), first_rank=r) for d, r in placed]
    heaps: dict[int, list[tuple[float, int]]] = {}
    for gi, g in enumerate(groups):
        heaps.setdefault(g.col, []).append((0.0, gi))
    for h in heaps.values():
        heapq.heapify(h)
    cols = sorted(heaps)
    cls = table.classes.class_of
    o, time_s, mem_b = table.overhead_s, table.time_s, table.mem_bytes
    for i in order:
        c = cls[i]
        best: tuple[float, float, int, int, int] | None = None
        for j in cols:
            t = time_s[c, j]
            if not np.isfinite(t):
                continue
            heap = heaps[j]
            # The least-loaded group of this size, and the next one if the first lacks room.
            for load, gi in heapq.nsmallest(2, heap):
                g = groups[gi]
                m = g.room(mem_b[c, j])
                finish = load + t + (o if m < 0 else 0.0)
                key = (finish, t * g.size, gi, m)
                if best is None or key < best[:4]:
                    best = (finish, t * g.size, gi, m, j)
        if best is None:
            return None
        finish, _, gi, m, j = best
        g = groups[gi]
        if m < 0:
            g.mbs.append([i])
            g.free_bytes.append(table.budget_bytes - mem_b[c, j])
        else:
            g.mbs[m].append(i)
            g.free_bytes[m] -= mem_b[c, j]
        heap = heaps[j]
        heap.remove((g.load_s, gi))
        heapq.heapify(heap)
        g.load_s = finish
        heapq.heappush(heap, (g.load_s, gi))
    return groups


def _group_time(table: CostTable, g: _Group) -> float:
    cls = table.classes.class_of
    return sum(table.time_s[cls[i], g.col] for mb in g.mbs for i in mb) + table.overhead_s * len(g.mbs)


def repack(table: CostTable, g: _Group) -> None:
    """Repack a group's samples first-fit-decreasing by memory when that opens fewer batches."""
    cls = table.classes.class_of
    items = sorted((i for mb in g.mbs for i in mb),
                   key=lambda i: (-table.mem_bytes[cls[i], g.col], i))
    mbs: list[list[int]] = []
    free: list[float] = []
    for i in items:
        mem = table.mem_bytes[cls[i], g.col]
        for m, f in enumerate(free):
            if f >= mem:
                mbs[m].append(i)
                free[m] -= mem
                break
        else:
            mbs.append([i])
            free.append(table.budget_bytes - mem)
    if len(mbs) < len(g.mbs):
        g.mbs, g.free_bytes = mbs, free
    g.load_s = _group_time(table, g)


def local_search(table: CostTable, groups: list[_Group], *, max_moves: int) -> None:
    """Move or swap samples off the slowest group while the makespan falls."""
    cls = table.classes.class_of
    o, time_s, mem_b = table.overhead_s, table.time_s, table.mem_bytes
    for _ in range(max_moves):
        top = max(range(len(groups)), key=lambda gi: (groups[gi].load_s, -gi))
        g = groups[top]
        current = g.load_s
        best: tuple[float, int, int, int, int] | None = None  # (new max, kind, mb, pos, dest)
        seen_cls: set[int] = set()
        for m, mb in enumerate(g.mbs):
            for p, i in enumerate(mb):
                c = cls[i]
                if c in seen_cls:
                    continue
                seen_cls.add(c)
                saved = time_s[c, g.col] + (o if len(mb) == 1 else 0.0)
                new_src = current - saved
                for hi, h in enumerate(groups):
                    if hi == top:
                        continue
                    t = time_s[c, h.col]
                    if not np.isfinite(t):
                        continue
                    add = t + (0.0 if h.room(mem_b[c, h.col]) >= 0 else o)
                    new_max = max(new_src, h.load_s + add)
                    if new_max < current - 1e-12 and (best is None or new_max < best[0]):
                        best = (new_max, 0, m, p, hi)
        if best is None:
            if not _swap(table, groups, top):
                break
            continue
        _, _, m, p, hi = best
        i = g.mbs[m].pop(p)
        g.free_bytes[m] += mem_b[cls[i], g.col]
        if not g.mbs[m]:
            del g.mbs[m]
            del g.free_bytes[m]
        g.load_s = _group_time(table, g)
        h = groups[hi]
        mh = h.room(mem_b[cls[i], h.col])
        if mh < 0:
            h.mbs.append([i])
            h.free_bytes.append(table.budget_bytes - mem_b[cls[i], h.col])
        else:
            h.mbs[mh].append(i)
            h.free_bytes[mh] -= mem_b[cls[i], h.col]
        h.load_s = _group_time(table, h)


def _swap(table: CostTable, groups: list[_Group], top: int) -> bool:
    """Swap one sample of the slowest group with a cheaper one elsewhere; True if done."""
    cls = table.classes.class_of
    time_s, mem_b = table.time_s, table.mem_bytes
    g = groups[top]
    current = g.load_s
    best: tuple[float, int, int, int, int, int, int] | None = None
    for m, mb in enumerate(g.mbs):
        for p, i in enumerate(mb):
            ci = cls[i]
            for hi, h in enumerate(groups):
                if hi == top:
                    continue
                for mh, mbh in enumerate(h.mbs):
                    for ph, k in enumerate(mbh):
                        ck = cls[k]
                        if ck == ci:
                            continue
                        ti_h, tk_g = time_s[ci, h.col], time_s[ck, g.col]
                        if not (np.isfinite(ti_h) and np.isfinite(tk_g)):
                            continue
                        # Same micro-batch slots: memory must fit in both after the swap.
                        if g.free_bytes[m] + mem_b[ci, g.col] < mem_b[ck, g.col]:
                            continue
                        if h.free_bytes[mh] + mem_b[ck, h.col] < mem_b[ci, h.col]:
                            continue
                        new_g = current - time_s[ci, g.col] + tk_g
                        new_h = h.load_s - time_s[ck, h.col] + ti_h
                        new_max = max(new_g, new_h)
                        if new_max < current - 1e-12 and (best is None or new_max < best[0]):
                            best = (new_max, m, p, hi, mh, ph, 0)
    if best is None:
        return False
    _, m, p, hi, mh, ph, _ = best
    h = groups[hi]
    i, k = g.mbs[m][p], h.mbs[mh][ph]
    g.mbs[m][p], h.mbs[mh][ph] = k, i
    g.free_bytes[m] += mem_b[cls[i], g.col] - mem_b[cls[k], g.col]
    h.free_bytes[mh] += mem_b[cls[k], h.col] - mem_b[cls[i], h.col]
    g.load_s = _group_time(table, g)
    h.load_s = _group_time(table, h)
    return True


def to_draft(table: CostTable, groups: list[_Group]) -> Draft:
    """Drafts with each sample at its cheapest fitting policy, micro-batches largest first."""
    cls = table.classes.class_of
    draft: Draft = []
    for g in groups:
        mbs = [[(i, int(table.k_min[cls[i], g.col])) for i in sorted(mb)] for mb in g.mbs]
        draft.append(DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=mbs))
    return draft


def heuristic_plan(table: CostTable, *, makespan_hint_s: float, num_candidates: int,
                   max_moves: int, num_refined: int = 2) -> tuple[Draft, list[list[int]]]:
    """The heuristic's best draft and the multisets it tried.

    Args:
        table: Costs of the batch.
        makespan_hint_s: A target compute makespan (the deadline-area bound).
        num_candidates: Most multisets to evaluate.
        max_moves: Local-search moves per refined candidate.
        num_refined: How many of the best LPT candidates get the local search.

    Raises:
        ValueError: when no multiset of allowed sizes can hold the batch.
    """
    multisets = candidate_multisets(table, makespan_s=makespan_hint_s, limit=num_candidates)
    if not multisets:
        raise ValueError(
            f"no partition of {table.cost_model.cluster.num_gpus} ranks into groups of sizes "
            f"{table.sizes} (nodes of {table.cost_model.cluster.gpus_per_node}) can hold the batch")
    order = _order(table)
    scored: list[tuple[float, int, list[_Group]]] = []
    for idx, ms in enumerate(multisets):
        groups = lpt(table, ms, order)
        if groups is None:
            continue
        scored.append((max(g.load_s for g in groups), idx, groups))
    if not scored:
        raise ValueError(f"no candidate partition of the world can hold every sample "
                         f"(sizes {table.sizes})")
    scored.sort(key=lambda item: (item[0], item[1]))
    best_groups: list[_Group] | None = None
    best_time = np.inf
    for _, _, groups in scored[:num_refined]:
        local_search(table, groups, max_moves=max_moves)
        for g in groups:
            repack(table, g)
        makespan = max(g.load_s for g in groups)
        if makespan < best_time - 1e-12:
            best_time, best_groups = makespan, groups
    assert best_groups is not None
    logger.debug("heuristic: %d multisets, best compute makespan %.6f s", len(multisets), best_time)
    return to_draft(table, best_groups), multisets
