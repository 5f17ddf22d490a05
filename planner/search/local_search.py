"""The local search that improves the heuristic's groups (``planner.search.group_state``).

It moves or swaps samples off the slowest group while that lowers the makespan, and when
stuck, optionally ejects (a one-for-many swap that lowers GPU-seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from planner.costs import CostTable
from planner.search.group_state import GroupState, group_time, insert_sample, remove_sample, repack


def local_search(table: CostTable, groups: list[GroupState], *, max_moves: int,
                 max_ejections: int = 0) -> set[int]:
    """Move or swap samples off the slowest group while the makespan falls.

    When neither helps, up to ``max_ejections`` times a one-for-many swap (``_eject``) that
    lowers the GPU-seconds of two groups without raising the makespan frees time for further
    moves.

    Returns:
        The indices of the groups whose samples or micro-batches it changed (a move, swap or
        ejection that was tried and undone leaves a group as it was).
    """
    changed: set[int] = set()
    if len(groups) < 2:
        return changed
    cls = table.classes.class_of
    cols = np.array([g.col for g in groups], dtype=np.int64)
    o_g = table.overhead_s_by_size[cols]  # micro-batch overhead of each group
    # Rows of class x group times and bytes, gathered for the classes the search touches
    # (a whole class x group matrix is 1 GB at 32,768 samples x 4,096 groups).
    time_rows: dict[int, np.ndarray] = {}
    mem_rows: dict[int, np.ndarray] = {}
    if table.intra_policies:  # loads priced with per-micro-batch policies from the start
        for g in groups:
            g.load_s = group_time(table, g)
    load = np.array([g.load_s for g in groups])
    max_free = np.array([max(g.free_bytes, default=-1.0) for g in groups])
    buf, extra = np.empty(len(groups)), np.empty(len(groups))  # a candidate's finishes, overheads
    opens = np.empty(len(groups), dtype=bool)  # where the candidate opens a micro-batch

    def refresh(gi: int) -> None:
        changed.add(gi)
        g = groups[gi]
        g.load_s = group_time(table, g)
        load[gi] = g.load_s
        max_free[gi] = max(g.free_bytes, default=-1.0)

    # Groups by size column, for each column's least load: a class's move lands no lower than
    # the least loaded group of some column plus its time there (a bound that skips the vectors).
    by_col = np.argsort(cols, kind="stable")
    col_ids, col_starts = np.unique(cols[by_col], return_index=True)
    floor_rows: dict[int, list[float]] = {}  # class -> its time on each column of col_ids
    rejected: set[tuple[int, int, int]] = set()  # (class, from, to) moves undone since a change
    for _ in range(max_moves):
        top = int(np.argmax(load))
        g = groups[top]
        current = load[top]
        limit = current * (1 - 1e-12)
        col_min = np.minimum.reduceat(load[by_col], col_starts).tolist()
        # One candidate per (class, alone) of the slowest group, in its order (pos): the makespan
        # after moving it is at least new_src (the slowest group without it). Scored in order of
        # new_src, the best (lowest makespan, then lowest pos: the first found in group order) is
        # found after a few vector evaluations, the rest pruned by new_src alone.
        time_top = table.time_s[:, int(cols[top])]
        o_top = o_g[top]
        entries: list[tuple[float, int, int, int]] = []  # (new_src, pos, sample, class)
        seen: set[tuple[int, bool]] = set()
        for mb in g.mbs:
            alone = len(mb) == 1
            for i in mb:
                c = cls[i]
                if (c, alone) in seen:
                    continue
                seen.add((c, alone))
                entries.append((current - time_top[c] - (o_top if alone else 0.0), len(entries), i, c))
        entries.sort()
        best: tuple[float, int, int, int] | None = None  # (new makespan, pos, sample, destination)
        for new_src, pos, i, c in entries:
            if not new_src < limit or (best is not None and new_src > best[0]):
                break  # sorted by new_src: no later candidate can win either
            if best is not None and new_src == best[0] and pos > best[1]:
                continue
            floor_row = floor_rows.get(c)
            if floor_row is None:
                floor_row = floor_rows[c] = table.time_s[c, col_ids].tolist()
            floor = max(new_src, min([m + t for m, t in zip(col_min, floor_row, strict=True)]))
            if not floor < limit or (best is not None and (floor > best[0] or (floor == best[0] and pos > best[1]))):
                continue  # no destination can make this move win
            t_row = time_rows.get(c)
            if t_row is None:
                # row, then take: the same values, a quarter of [c, cols]'s time at 11,000 groups
                t_row = time_rows[c] = table.time_s[c].take(cols)
                mem_rows[c] = table.mem_bytes[c].take(cols)
            # cand = max(load + t_row + o_g * (max_free < bytes), new_src), in preallocated
            # buffers: the same operations, without four fresh arrays per candidate (at 11,000
            # groups their allocation and first touch cost several times the arithmetic).
            cand = np.add(load, t_row, out=buf)
            np.less(max_free, mem_rows[c], out=opens)
            cand += np.multiply(o_g, opens, out=extra)
            cand[top] = np.inf
            np.maximum(cand, new_src, out=cand)
            for key in rejected:
                if key[0] == c and key[1] == top:
                    cand[key[2]] = np.inf
            h = int(np.argmin(cand))
            if cand[h] < limit and (best is None or (cand[h], pos) < (best[0], best[1])):
                best = (float(cand[h]), pos, i, h)
        if best is not None:
            _, _, i, h = best
            remove_sample(table, g, i)
            insert_sample(table, groups[h], i)
            refresh(top)
            refresh(h)
            if not table.intra_policies or max(load[top], load[h]) < current * (1 - 1e-12):
                rejected.clear()
                continue
            # Priced with per-micro-batch policies the move does not pay: undo it.
            rejected.add((cls[i], top, h))
            remove_sample(table, groups[h], i)
            insert_sample(table, g, i)
            refresh(top)
            refresh(h)
            continue
        if _swap(table, groups, top, load, cols, refresh):
            rejected.clear()
            continue
        if max_ejections <= 0:
            break
        max_ejections -= 1
        if _eject(table, groups, load, refresh) is None:
            break
    return changed


def _swap(table: CostTable, groups: list[GroupState], top: int, load: np.ndarray,
          cols: np.ndarray, refresh: Callable[[int], None], *, max_tries: int = 4,
          max_classes: int = 4, max_partners: int = 32) -> bool:
    """Swap a sample of the slowest group with a cheaper one elsewhere; True if it helped.

    Every (class on the slowest group, class on one of the ``max_partners`` least loaded other
    groups) pair is scored at once; the few best are tried with exact micro-batch packing, the
    first that lowers both groups below the current makespan is kept.
    """
    cls = table.classes.class_of
    g = groups[top]
    current = load[top]
    firsts: dict[int, int] = {}
    for mb in g.mbs:
        for i in mb:
            firsts.setdefault(cls[i], i)
    # The classes that take longest on the slowest group are the ones worth swapping out.
    t_top = table.time_s[:, cols[top]]
    top_classes = np.array(sorted(firsts, key=lambda c: (-t_top[c], c))[:max_classes],
                           dtype=np.int64)
    others = np.flatnonzero(np.arange(len(groups)) != top)
    if others.size > max_partners:
        others = others[np.argsort(load[others], kind="stable")[:max_partners]]
    # (partner group, class present there) pairs.
    pairs = sorted({(int(h), cls[i]) for h in others for mb in groups[h].mbs for i in mb})
    if not pairs:
        return False
    hs = np.array([h for h, _ in pairs], dtype=np.int64)
    ck = np.array([c for _, c in pairs], dtype=np.int64)
    # new_top[a, p]: slowest group after swapping class top_classes[a] out and ck[p] in.
    new_top = current - t_top[top_classes][:, None] + t_top[ck][None, :]
    with np.errstate(invalid="ignore"):
        # new_h[a, p]: group hs[p] after swapping ck[p] out and class top_classes[a] in.
        new_h = (load[hs][None, :] - table.time_s[ck, cols[hs]][None, :]
                 + table.time_s[top_classes][:, cols[hs]])
        cand = np.maximum(new_h, new_top)
    cand[np.isnan(cand)] = np.inf
    flat = cand.ravel()
    good = np.flatnonzero(flat < current * (1 - 1e-12))
    if good.size == 0:
        return False
    tries = good[np.argsort(flat[good], kind="stable")][:max_tries]
    for index in tries:
        a, p = divmod(int(index), hs.size)
        ci, h, c_k = int(top_classes[a]), int(hs[p]), int(ck[p])
        if ci == c_k:
            continue
        i = firsts[ci]
        other = groups[h]
        k = next(x for m in other.mbs for x in m if cls[x] == c_k)
        saved = ([list(m) for m in g.mbs], list(g.free_bytes),
                 [list(m) for m in other.mbs], list(other.free_bytes))
        remove_sample(table, g, i)
        remove_sample(table, other, k)
        insert_sample(table, g, k)
        insert_sample(table, other, i)
        if max(group_time(table, g), group_time(table, other)) < current * (1 - 1e-12):
            refresh(top)
            refresh(h)
            return True
        g.mbs, g.free_bytes, other.mbs, other.free_bytes = saved
    return False


_SPILL_SCAN_GROUPS = 256
"""Worlds of up to this many groups spill an ejection's overflow with a plain scan (numpy's
per-call cost dominates there); larger ones score every group at once."""


def _eject(table: CostTable, groups: list[GroupState], load: np.ndarray,
           refresh: Callable[[int], None], *, max_classes: int = 4, max_per_size: int = 3,
           max_overflow_tries: int = 6, max_givers: int = 64) -> list[int] | None:
    """One-for-many swap between a larger group ``h`` and a smaller group ``g``.

    A sample ``x`` of ``g`` moves to ``h``, which makes room by ejecting to ``g`` the samples
    it runs least efficiently (largest GPU-seconds on ``h`` over GPU-seconds on ``g``), so that
    neither group ends above the current makespan and the GPU-seconds (size x load) of the
    groups touched strictly fall. Where ``g`` then overflows, its smallest samples move to the
    least loaded other groups that stay under the makespan (tried for the few most promising
    swaps only). The smaller groups considered are the ``max_per_size`` least loaded of each
    size. Small samples left in the slack of a huge sample's group are what the
    one-sample moves and swaps cannot fix: the freed time then lets those moves lower the
    makespan. The total GPU-seconds fall at every ejection, so ejections cannot cycle.
    Returns the groups changed, or None.
    """
    cls = table.classes.class_of
    limit = float(load.max())
    cap = limit * (1 - 1e-9)
    # Plain lists: a few dozen samples per group pair, where numpy scalar indexing dominates.
    cols = [g.col for g in groups]
    col_of = np.asarray(cols, dtype=np.int64)
    rows = table.rows()[0]  # rows[c][cols[g]]: class c on group g
    loads: list[float] = load.tolist()
    sizes = [g.size for g in groups]
    Moves = list[tuple[int, int, int]]  # (sample, from group, to group)
    best: tuple[float, Moves] | None = None
    overflow: list[tuple[float, float, int, int, Moves]] = []  # (area, new_g, h, g, moves)
    # Receiving groups: the ``max_per_size`` least loaded of each size.
    receivers: list[int] = []
    index = np.arange(len(groups))
    for col in sorted(set(cols)):
        members = index[col_of == col]  # ascending; lexsort: by load, ties by index
        receivers += members[np.lexsort((members, load[members]))[:max_per_size]].tolist()
    receivers.sort()
    # The classes of each receiver worth moving out (longest there first), one sample each.
    leaving: dict[int, list[tuple[int, int]]] = {}
    for g in receivers:
        firsts: dict[int, int] = {}
        for mb in groups[g].mbs:
            for i in mb:
                firsts.setdefault(cls[i], i)
        col_g = cols[g]
        leaving[g] = [(c, firsts[c]) for c in
                      sorted(firsts, key=lambda c: (-rows[c][col_g], c))[:max_classes]]
    # Larger groups: the ``max_givers`` most loaded (all of them in worlds of up to that many
    # groups; beyond, the scan over every pair dominated the planner at 2,048+ groups).
    givers = np.lexsort((index, -load))[:max_givers].tolist()
    for h in sorted(givers):
        gh = groups[h]
        col_h = cols[h]
        items_h = [(cls[i], i) for mb in gh.mbs for i in mb]
        by_col: dict[int, list[tuple[float, int, int]]] = {}
        for g in receivers:
            gg = groups[g]
            if gg.size >= gh.size:
                continue
            col_g = cols[g]
            # Samples of h that run in fewer GPU-seconds on g, the most so (relatively) first
            # (the same for every group of g's size).
            scored = by_col.get(gg.col)
            if scored is None:
                scored = []
                for c, i in items_h:
                    row = rows[c]
                    area_g, area_h = gg.size * row[col_g], gh.size * row[col_h]
                    if area_g < area_h:
                        scored.append((area_g / area_h, i, c))
                scored.sort()
                by_col[gg.col] = scored
            if not scored:
                continue
            for c, x in leaving[g]:
                t_xh, t_xg = rows[c][col_h], rows[c][col_g]
                if t_xh == np.inf:
                    continue
                new_h = loads[h] + t_xh
                new_g = loads[g] - t_xg
                area = gh.size * t_xh - gg.size * t_xg
                moves: Moves = [(x, g, h)]
                for _, i, ci in scored:
                    if new_h <= cap:
                        break
                    row = rows[ci]
                    t_h, t_g = row[col_h], row[col_g]
                    new_h -= t_h
                    new_g += t_g
                    area += gg.size * t_g - gh.size * t_h
                    moves.append((i, h, g))
                if len(moves) < 2 or new_h > cap:
                    continue
                if new_g <= cap:
                    if area < -1e-9 * limit and (best is None or area < best[0]):
                        best = (area, moves)
                elif area < -1e-9 * limit:
                    overflow.append((area, new_g, h, g, moves))
    overflow.sort(key=lambda item: item[0])
    for area, new_g, h, g, moves in overflow[:max_overflow_tries]:
        if best is not None and area >= best[0]:
            break
        # g's own samples (not the one leaving), smallest first, to the least loaded others.
        moved = {m[0] for m in moves}
        col_g = cols[g]
        own = sorted((rows[cls[i]][col_g], i) for mb in groups[g].mbs for i in mb
                     if i not in moved)
        # The least loaded other group that stays under the makespan with the sample: every
        # group's finish at once with numpy in large worlds, a plain scan in small ones (the
        # same float sums in group order; the lowest index among equal finishes).
        extra = np.zeros(len(groups))
        extra_l = [0.0] * len(groups)
        spill: Moves = []
        for t_g, i in own:
            if new_g <= cap:
                break
            row = rows[cls[i]]
            if len(groups) <= _SPILL_SCAN_GROUPS:
                k_best, f_best = -1, math.inf
                for k in range(len(groups)):
                    f = loads[k] + extra_l[k] + row[cols[k]]
                    if f <= cap and f < f_best and k != h and k != g:
                        k_best, f_best = k, f
                if k_best < 0:
                    continue
            else:
                finish = load + extra + table.time_s[cls[i]].take(col_of)
                finish[[h, g]] = np.inf
                finish[~(finish <= cap)] = np.inf
                k_best = int(np.argmin(finish))
                if finish[k_best] == np.inf:
                    continue
            t_k = row[cols[k_best]]
            extra[k_best] += t_k
            extra_l[k_best] += t_k
            new_g -= t_g
            area += sizes[k_best] * t_k - sizes[g] * t_g
            spill.append((i, g, k_best))
        if new_g <= cap and area < -1e-9 * limit and (best is None or area < best[0]):
            best = (area, moves + spill)
    if best is None:
        return None
    moves = best[1]
    touched = sorted({m[1] for m in moves} | {m[2] for m in moves})
    area_before = sum(groups[k].size * groups[k].load_s for k in touched)
    saved = {k: ([list(m) for m in groups[k].mbs], list(groups[k].free_bytes)) for k in touched}
    for i, src, _ in moves:
        remove_sample(table, groups[src], i)
    for i, _, dst in moves:
        insert_sample(table, groups[dst], i)
    for k in touched:
        repack(table, groups[k])
    if (max(groups[k].load_s for k in touched) > cap
            or sum(groups[k].size * groups[k].load_s for k in touched) >= area_before * (1 - 1e-9)):
        # The micro-batch overheads did not fit after all.
        for k in touched:
            groups[k].mbs, groups[k].free_bytes = saved[k]
            groups[k].load_s = group_time(table, groups[k])
        return None
    for k in touched:
        refresh(k)
    return touched

