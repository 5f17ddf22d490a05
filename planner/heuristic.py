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


def lpt(table: CostTable, multiset: list[int], order: list[int], *, target_s: float | None = None,
        strict: bool = False) -> list[_Group] | None:
    """Assign samples to the groups of a multiset.

    Without a target: earliest finish first (LPT). With a target makespan: among the groups
    where the sample finishes by the target, the one that runs it in the fewest GPU-seconds
    (then the fullest: best fit); earliest finish when no group meets the target. Each group
    fills its last micro-batch until the next sample does not fit, then opens another.
    ``strict`` gives up (None) as soon as a sample cannot meet the target.
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
    # Runs of identical samples (same class, consecutive in the order) are placed in bulk: the
    # chosen group keeps taking copies while the per-sample rule would still choose it.
    pos = 0
    while pos < len(order):
        c = cls[order[pos]]
        end = pos + 1
        while end < len(order) and cls[order[end]] == c:
            end += 1
        m_row = layout.mem_bytes[c]
        t_row = layout.time_s[c]
        while pos < end:
            need = free < m_row
            finish = load + t_row + o * need
            gi = -1
            limit = inf
            if target_s is not None:
                key = np.where(finish <= target_s, keys[c] - finish, inf)
                gi = int(key.argmin())
                if key[gi] == inf:
                    if strict:
                        return None
                    gi = -1
                else:
                    limit = target_s
            if gi < 0:
                gi = int(finish.argmin())
                if finish[gi] == inf:
                    return None
                if end - pos > 1 and num_groups > 1:
                    finish[gi] = inf
                    limit = float(finish.min())
            g = groups[gi]
            t, m = float(t_row[gi]), float(m_row[gi])
            ld, fr = float(load[gi]), float(free[gi])
            first = True
            while pos < end:
                opens = fr < m
                nxt = ld + t + (o if opens else 0.0)
                if not first and nxt > limit:
                    break
                first = False
                i = order[pos]
                if opens:
                    fr = budget - m
                    g.mbs.append([i])
                    g.free_bytes.append(fr)
                else:
                    fr -= m
                    g.mbs[-1].append(i)
                    g.free_bytes[-1] = fr
                ld = nxt
                pos += 1
            load[gi], free[gi] = ld, fr
    for gi, g in enumerate(groups):
        g.load_s = float(load[gi])
    return groups


def packed_multiset(table: CostTable, order: list[int], *, target_s: float,
                    fill_tolerance: float = 1.3) -> list[int] | None:
    """The groups a target makespan calls for: bin packing with groups opened on demand.

    Each sample (decreasing work) goes to the fullest open group of its most efficient size
    that meets the target, or opens one. The result accounts for whole samples (two samples
    that each need half the target on a group of 4 need two such groups), which the
    fractional demands of ``candidate_multisets`` do not. Returns the multiset, filled up to
    the world size with the smallest groups, or None if it needs more ranks than the world has
    or a sample cannot meet the target.
    """
    cluster = table.cost_model.cluster
    n = cluster.num_gpus
    sizes = np.asarray(table.sizes, dtype=np.float64)
    o, budget = table.overhead_s, table.budget_bytes
    meets = table.time_s + o <= target_s
    if not meets.any(axis=1).all():
        return None
    area = np.where(meets, table.time_s * sizes[None, :], np.inf)
    best_col = area.argmin(axis=1)
    cls = table.classes.class_of
    # Open groups per size column: lists of [load, free bytes of the open micro-batch].
    open_groups: dict[int, list[list[float]]] = {}
    used = 0
    pos = 0
    while pos < len(order):
        c = cls[order[pos]]
        end = pos + 1
        while end < len(order) and cls[order[end]] == c:
            end += 1
        jb = int(best_col[c])
        # Sizes to try: the most efficient first, then open groups of sizes within the
        # tolerance (leftover time of a big group is worth filling with mid-size samples).
        tolerated = [jb] + [j for j in np.argsort(area[c], kind="stable").tolist()
                            if j != jb and area[c, j] <= area[c, jb] * fill_tolerance]
        while pos < end:
            # Fullest group that still meets the target with one more copy.
            best_k, best_finish, j = -1, -1.0, jb
            for jj in tolerated:
                t = float(table.time_s[c, jj])
                m = float(table.mem_bytes[c, jj])
                for k, (ld, fr) in enumerate(open_groups.get(jj, [])):
                    finish = ld + t + (o if fr < m else 0.0)
                    if finish <= target_s and finish > best_finish:
                        best_k, best_finish, j = k, finish, jj
                if best_k >= 0:
                    break
            pool = open_groups.setdefault(j, [])
            if best_k < 0:
                used += table.sizes[j]
                if used > n:
                    return None
                pool.append([0.0, -1.0])
                best_k = len(pool) - 1
            t, m = float(table.time_s[c, j]), float(table.mem_bytes[c, j])
            state = pool[best_k]
            first = True
            while pos < end:
                opens = state[1] < m
                nxt = state[0] + t + (o if opens else 0.0)
                if not first and nxt > target_s:
                    break
                first = False
                state[1] = budget - m if opens else state[1] - m
                state[0] = nxt
                pos += 1
    filler = fill_ranks(n - used, table.sizes)
    if filler is None:
        return None
    multiset = [table.sizes[j] for j, pool in open_groups.items() for _ in pool] + filler
    return sorted(multiset, reverse=True)


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
          time_s: np.ndarray, refresh: Callable[[int], None], *, max_tries: int = 4,
          max_classes: int = 4) -> bool:
    """Swap a sample of the slowest group with a cheaper one elsewhere; True if it helped.

    Every (class on the slowest group, other group, class there) triple is scored at once; the
    few best are tried with exact micro-batch packing, the first that lowers both groups below
    the current makespan is kept.
    """
    cls = table.classes.class_of
    g = groups[top]
    current = load[top]
    present = counts > 0
    present[top] = False
    firsts: dict[int, int] = {}
    for mb in g.mbs:
        for i in mb:
            firsts.setdefault(cls[i], i)
    # The classes that take longest on the slowest group are the ones worth swapping out.
    top_classes = np.array(sorted(firsts, key=lambda c: (-time_s[c, top], c))[:max_classes],
                           dtype=np.int64)
    # new_top[a, k]: slowest group after swapping class top_classes[a] out and k in.
    new_top = current - time_s[top_classes, top][:, None] + time_s[:, top][None, :]
    with np.errstate(invalid="ignore"):
        # new_h[a, h, k]: group h after swapping k out and class top_classes[a] in.
        new_h = load[None, :, None] - time_s.T[None, :, :] + time_s[top_classes][:, :, None]
        cand = np.maximum(new_h, new_top[:, None, :])
    cand = np.where(present[None, :, :], cand, np.inf)
    cand[np.isnan(cand)] = np.inf
    flat = cand.ravel()
    good = np.flatnonzero(flat < current * (1 - 1e-12))
    if good.size == 0:
        return False
    tries = good[np.argsort(flat[good], kind="stable")][:max_tries]
    num_groups, num_classes = cand.shape[1], cand.shape[2]
    for index in tries:
        a, rest = divmod(int(index), num_groups * num_classes)
        h, ck = divmod(rest, num_classes)
        ci = int(top_classes[a])
        if ci == ck:
            continue
        i = firsts[ci]
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
                   num_lpt_runs: int, max_moves: int, num_refined: int = 2,
                   num_target_probes: int = 4) -> tuple[Draft, list[list[int]]]:
    """The heuristic's best draft and the multisets it tried.

    Args:
        table: Costs of the batch.
        makespan_hint_s: A target compute makespan (the tightest lower bound).
        num_candidates: Most multisets to generate.
        num_lpt_runs: Most (multiset, target) LPT runs, in order of promise: every multiset
            with no target and with the bound as target, then the looser targets.
        max_moves: Local-search moves per refined candidate.
        num_refined: How many of the best multisets get the target bisection, and how many of
            the best results the local search.
        num_target_probes: Bisection steps on the target makespan per refined multiset.

    Raises:
        ValueError: when no multiset of allowed sizes can hold the batch.
    """
    # Only as many multisets as the LPT runs can use (two runs each, then uniform ones).
    multisets = candidate_multisets(table, makespan_s=makespan_hint_s,
                                    limit=min(num_candidates, max(2, num_lpt_runs // 2 + 1)))
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
    probed: list[tuple[float, int, list[_Group]]] = []
    # Bisection on the target of the on-demand packing, whose multisets then get the LPT.
    lo, hi = makespan_hint_s, scored[0][0]
    seen = {tuple(ms) for ms in multisets}
    for _ in range(num_target_probes + 2):
        mid = 0.5 * (lo + hi)
        ms_new = packed_multiset(table, order, target_s=mid)
        if ms_new is None:
            lo = mid
            continue
        hi = mid
        if tuple(ms_new) in seen:
            continue
        seen.add(tuple(ms_new))
        for target in (mid, None):
            trial = lpt(table, ms_new, order, target_s=target)
            if trial is not None:
                probed.append((max(g.load_s for g in trial), -1 - len(probed), trial))
    scored = sorted(scored + probed, key=lambda item: (item[0], item[1]))
    probed = []
    # Bisection on the target makespan for the best multisets: the smallest target every sample
    # can meet (strict LPT), between the bound and the best makespan found.
    for rank, (makespan, _, groups) in enumerate(scored[:max(1, num_refined)]):
        ms = sorted((g.size for g in groups), reverse=True)
        lo, hi = makespan_hint_s, makespan
        for probe in range(num_target_probes):
            mid = 0.5 * (lo + hi)
            trial = lpt(table, ms, order, target_s=mid, strict=True)
            if trial is None:
                lo = mid
                continue
            hi = max(g.load_s for g in trial)
            probed.append((hi, len(runs) + rank * num_target_probes + probe, trial))
    scored = sorted(scored + probed, key=lambda item: (item[0], item[1]))
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
