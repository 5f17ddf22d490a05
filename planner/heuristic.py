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

import logging
from collections.abc import Callable
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
    whole = np.floor(groups + 1e-9).astype(int)
    if ceil_largest:
        used = 0
        for j in sorted(range(len(sizes)), key=lambda j: -sizes[j]):
            want = int(np.ceil(groups[j] - 1e-9))
            take = min(want, (n - used) // sizes[j])
            whole[j] = take
            used += take * sizes[j]
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


@dataclass(slots=True)
class _Layout:
    """Groups of one multiset with per-class cost rows gathered per group (class x group)."""

    groups: list[_Group]
    time_s: np.ndarray
    mem_bytes: np.ndarray
    area_rank: np.ndarray
    """Rank of each group's size by the class's GPU-seconds on it (0: most efficient)."""


def _layout(table: CostTable, multiset: list[int]) -> _Layout | None:
    cluster = table.cost_model.cluster
    placed = place_groups(multiset, num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    groups = [_Group(size=d, col=table.size_index(d), first_rank=r) for d, r in placed]
    cols = np.array([g.col for g in groups], dtype=np.int64)
    sizes = np.asarray(table.sizes, dtype=np.float64)
    area = table.time_s * sizes[None, :]
    rank = np.argsort(np.argsort(area, axis=1, kind="stable"), axis=1, kind="stable")
    return _Layout(groups=groups, time_s=table.time_s[:, cols], mem_bytes=table.mem_bytes[:, cols],
                   area_rank=rank[:, cols].astype(np.float64))


def lpt(table: CostTable, multiset: list[int], order: list[int], *, target_s: float | None = None
        ) -> list[_Group] | None:
    """Assign samples to the groups of a multiset.

    Without a target: earliest finish first (LPT). With a target makespan: among the groups
    where the sample finishes by the target, the one that runs it in the fewest GPU-seconds
    (then the fullest: best fit); earliest finish when no group meets the target. Each group
    fills its last micro-batch until the next sample does not fit, then opens another.
    """
    layout = _layout(table, multiset)
    if layout is None:
        return None
    groups = layout.groups
    num_groups = len(groups)
    cls = table.classes.class_of
    o, budget = table.overhead_s, table.budget_bytes
    load = np.zeros(num_groups)
    free = np.full(num_groups, -1.0)  # free bytes of each group's open micro-batch
    scale = 4.0 * (target_s or 1.0) + 1.0  # key = area rank * scale - finish orders both
    keys = layout.area_rank * scale
    inf = np.inf
    for i in order:
        c = cls[i]
        m_row = layout.mem_bytes[c]
        need = free < m_row
        finish = load + layout.time_s[c] + o * need
        gi = -1
        if target_s is not None:
            key = np.where(finish <= target_s, keys[c] - finish, inf)
            gi = int(key.argmin())
            if key[gi] == inf:
                gi = -1
        if gi < 0:
            gi = int(finish.argmin())
            if finish[gi] == inf:
                return None
        g = groups[gi]
        if need[gi]:
            g.mbs.append([i])
            g.free_bytes.append(budget - m_row[gi])
        else:
            g.mbs[-1].append(i)
            g.free_bytes[-1] -= m_row[gi]
        free[gi] = g.free_bytes[-1]
        load[gi] = finish[gi]
    for gi, g in enumerate(groups):
        g.load_s = float(load[gi])
    return groups


def _group_time(table: CostTable, g: _Group) -> float:
    cls = table.classes.class_of
    return (sum(table.time_s[cls[i], g.col] for mb in g.mbs for i in mb)
            + table.overhead_s * len(g.mbs))


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


def _insert(table: CostTable, g: _Group, i: int) -> None:
    mem = table.mem_bytes[table.classes.class_of[i], g.col]
    m = g.room(mem)
    if m < 0:
        g.mbs.append([i])
        g.free_bytes.append(table.budget_bytes - mem)
    else:
        g.mbs[m].append(i)
        g.free_bytes[m] -= mem


def _remove(table: CostTable, g: _Group, i: int) -> None:
    for m, mb in enumerate(g.mbs):
        if i in mb:
            mb.remove(i)
            g.free_bytes[m] += table.mem_bytes[table.classes.class_of[i], g.col]
            if not mb:
                del g.mbs[m]
                del g.free_bytes[m]
            return
    raise AssertionError(f"sample {i} is not in the group")


def local_search(table: CostTable, groups: list[_Group], *, max_moves: int) -> None:
    """Move or swap samples off the slowest group while the makespan falls."""
    if len(groups) < 2:
        return
    cls = table.classes.class_of
    o = table.overhead_s
    cols = np.array([g.col for g in groups], dtype=np.int64)
    time_s = table.time_s[:, cols]
    mem_b = table.mem_bytes[:, cols]
    load = np.array([g.load_s for g in groups])
    max_free = np.array([max(g.free_bytes, default=-1.0) for g in groups])
    counts = np.zeros((len(groups), table.classes.num_classes), dtype=np.int64)
    for gi, g in enumerate(groups):
        for mb in g.mbs:
            for i in mb:
                counts[gi, cls[i]] += 1

    def refresh(gi: int) -> None:
        g = groups[gi]
        g.load_s = _group_time(table, g)
        load[gi] = g.load_s
        max_free[gi] = max(g.free_bytes, default=-1.0)

    for _ in range(max_moves):
        top = int(np.argmax(load))
        g = groups[top]
        current = load[top]
        best: tuple[float, int, int] | None = None  # (new makespan, sample, destination)
        seen: set[tuple[int, bool]] = set()
        for mb in g.mbs:
            alone = len(mb) == 1
            for i in mb:
                c = cls[i]
                if (c, alone) in seen:
                    continue
                seen.add((c, alone))
                new_src = current - time_s[c, top] - (o if alone else 0.0)
                new_dst = load + time_s[c] + o * (max_free < mem_b[c])
                new_dst[top] = np.inf
                cand = np.maximum(new_dst, new_src)
                h = int(np.argmin(cand))
                if cand[h] < current * (1 - 1e-12) and (best is None or cand[h] < best[0]):
                    best = (float(cand[h]), i, h)
        if best is not None:
            _, i, h = best
            _remove(table, g, i)
            _insert(table, groups[h], i)
            counts[top, cls[i]] -= 1
            counts[h, cls[i]] += 1
            refresh(top)
            refresh(h)
            continue
        if not _swap(table, groups, top, load, counts, time_s, refresh):
            break


def _swap(table: CostTable, groups: list[_Group], top: int, load: np.ndarray, counts: np.ndarray,
          time_s: np.ndarray, refresh: Callable[[int], None]) -> bool:
    """Swap a sample of the slowest group with a cheaper one elsewhere; True if it helped."""
    cls = table.classes.class_of
    g = groups[top]
    current = load[top]
    present = counts > 0
    present[top] = False
    tried: set[int] = set()
    candidates = []
    for mb in g.mbs:
        for i in mb:
            if cls[i] not in tried:
                tried.add(cls[i])
                candidates.append(i)
    for i in candidates:
        ci = cls[i]
        # new_top[k] for every class k; new_h[h, k] for every group and class.
        new_top = current - time_s[ci, top] + time_s[:, top]
        with np.errstate(invalid="ignore"):
            new_h = load[:, None] - time_s.T + time_s[ci][:, None]
        cand = np.where(present, np.maximum(new_h, new_top[None, :]), np.inf)
        flat = int(np.argmin(cand))
        h, ck = divmod(flat, cand.shape[1])
        if not cand[h, ck] < current * (1 - 1e-12):
            continue
        other = groups[h]
        k = next(x for m in other.mbs for x in m if cls[x] == ck)
        saved = ([list(m) for m in g.mbs], list(g.free_bytes),
                 [list(m) for m in other.mbs], list(other.free_bytes))
        _remove(table, g, i)
        _remove(table, other, k)
        _insert(table, g, k)
        _insert(table, other, i)
        if max(_group_time(table, g), _group_time(table, other)) < current * (1 - 1e-12):
            counts[top, ci] -= 1
            counts[top, ck] += 1
            counts[h, ck] -= 1
            counts[h, ci] += 1
            refresh(top)
            refresh(h)
            return True
        g.mbs, g.free_bytes, other.mbs, other.free_bytes = saved
    return False


def to_draft(table: CostTable, groups: list[_Group]) -> Draft:
    """Drafts with each sample at its cheapest fitting policy, micro-batches largest first."""
    cls = table.classes.class_of
    draft: Draft = []
    for g in groups:
        mbs = [[(i, int(table.k_min[cls[i], g.col])) for i in sorted(mb)] for mb in g.mbs]
        draft.append(DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=mbs))
    return draft


def heuristic_plan(table: CostTable, *, makespan_hint_s: float, num_candidates: int,
                   num_lpt_runs: int, max_moves: int, num_refined: int = 2
                   ) -> tuple[Draft, list[list[int]]]:
    """The heuristic's best draft and the multisets it tried.

    Args:
        table: Costs of the batch.
        makespan_hint_s: A target compute makespan (the tightest lower bound).
        num_candidates: Most multisets to generate.
        num_lpt_runs: Most (multiset, target) LPT runs, in order of promise: every multiset
            with no target and with the bound as target, then the looser targets.
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
    runs: list[tuple[list[int], float | None]] = []
    for factors in ((None, 1.0), (1.03, 1.07, 1.15)):
        for ms in multisets:
            runs.extend((ms, None if f is None else makespan_hint_s * f) for f in factors)
    scored: list[tuple[float, int, list[_Group]]] = []
    for idx, (ms, target) in enumerate(runs[:max(1, num_lpt_runs)]):
        groups = lpt(table, ms, order, target_s=target)
        if groups is not None:
            scored.append((max(g.load_s for g in groups), idx, groups))
    if not scored:  # every sample fits the largest size, so the largest uniform multiset works
        for idx, (ms, target) in enumerate(runs):
            groups = lpt(table, ms, order, target_s=target)
            if groups is not None:
                scored.append((max(g.load_s for g in groups), idx, groups))
                break
    if not scored:
        raise ValueError(f"no candidate partition of the world can hold every sample "
                         f"(sizes {table.sizes})")
    scored.sort(key=lambda item: (item[0], item[1]))
    best_groups: list[_Group] | None = None
    best_time = np.inf
    for _, _, groups in scored[:max(1, num_refined)]:
        local_search(table, groups, max_moves=max_moves)
        for g in groups:
            repack(table, g)
        makespan = max(g.load_s for g in groups)
        if makespan < best_time - 1e-12:
            best_time, best_groups = makespan, groups
    assert best_groups is not None
    logger.debug("heuristic: %d multisets, %d runs, best compute makespan %.6f s",
                 len(multisets), len(scored), best_time)
    return to_draft(table, best_groups), multisets
