"""LPT assignment of samples to the groups of one multiset, in ``O(log G)`` per sample.

Groups of one size (one column of the cost table) cost the same, so per size the groups are
kept in a list sorted by load: the earliest finish of a size is among its few least loaded
groups (a group with more load can win only by saving a micro-batch overhead), and the best
fit under a target is found by bisection on ``target - time``. Only the few groups nearest to
those points are examined (``SCAN``), so a sample costs ``O(sizes * (SCAN + log G))`` instead of
``O(G)`` (1,024 groups at 8,192 samples made the per-group scan dominate the planner).
"""

from __future__ import annotations

import bisect
import math
import weakref

from planner.costs import CostTable
from planner.placement import place_groups
from planner.search.group_state import GroupState

SCAN = 8
"""Groups examined per size around the least loaded one or the bisection point."""


_COL_ORDERS: weakref.WeakKeyDictionary[CostTable, dict[tuple[int, ...], dict[int, list[int]]]] = (
    weakref.WeakKeyDictionary())
"""Per live cost table and set of size columns: each class's columns by GPU-seconds rank."""


def _bulk_runs(order: list[int], cls: list[int]) -> list[int]:
    """End positions of runs of identical samples (same class) in ``order``."""
    ends: list[int] = []
    for pos in range(1, len(order) + 1):
        if pos == len(order) or cls[order[pos]] != cls[order[pos - 1]]:
            ends.append(pos)
    return ends


def lpt(table: CostTable, multiset: list[int], order: list[int], *, target_s: float | None = None,
        strict: bool = False, runs: list[int] | None = None,
        remember_failures: bool = True) -> list[GroupState] | None:
    """Assign samples to the groups of a multiset.

    Without a target: earliest finish first (LPT). With a target makespan: among the groups
    where the sample finishes by the target, one of the size that runs it in the fewest
    GPU-seconds, and of those the fullest (best fit); earliest finish when no group meets the
    target. Each group fills its last micro-batch until the next sample does not fit, then
    opens another (paying its size's micro-batch overhead). ``strict`` gives up (None) as soon
    as a sample cannot meet the target. ``runs`` (from ``heuristic.bucket_runs``; default: runs
    of identical samples) are placed in bulk: the group chosen for a run's next sample keeps
    taking the run's following samples, each at its own exact cost, while it still finishes
    no later than the target (or than the second-best group's finish). ``remember_failures``
    skips the target rule's recheck of a size that failed for the same class and has not changed
    since (the same groups; False rechecks every size, the reference the tests compare with).
    """
    cluster = table.cost_model.cluster
    placed = place_groups(multiset, num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    groups = [GroupState(size=d, col=table.size_index(d), first_rank=r) for d, r in placed]
    time_rows, mem_rows, rank_rows = table.rows()
    overhead = table.overhead_s_by_size.tolist()
    budget = table.budget_bytes
    cols = sorted({state.col for state in groups})
    # Per size column (a list indexed by column: the hot loop reads it per sample), its groups as
    # (load, group, free bytes of its open micro-batch), sorted: the group index is unique, so the
    # free bytes only ride along (the scans below read them without indexing ``free``).
    by_load: list[list[tuple[float, int, float]]] = [[] for _ in overhead]
    for index, state in enumerate(groups):
        by_load[state.col].append((0.0, index, -1.0))
    load = [0.0] * len(groups)
    free = [-1.0] * len(groups)  # free bytes of each group's open micro-batch
    cls = table.classes.class_of
    inf = math.inf
    if runs is None:
        runs = _bulk_runs(order, cls)
    ocls = list(map(cls.__getitem__, order))  # class of each position
    # Per column: time and bytes by class (empty for columns without groups).
    columns = [table.column(j)[4:6] if j in cols else ([], []) for j in range(len(overhead))]
    bisect_left, bisect_right, insort = bisect.bisect_left, bisect.bisect_right, bisect.insort
    # Columns by GPU-seconds rank per class, for the target rule (computed once per class and
    # set of columns: the heuristic's runs share them).
    orders = _COL_ORDERS.get(table)
    if orders is None:
        orders = _COL_ORDERS[table] = {}
    col_order = orders.setdefault(tuple(cols), {})
    # The target rule's failures, remembered: a column where no group met the target for a
    # sample of class ``fail_cls`` fails again for the next sample of that class as long as the
    # column is unchanged (its groups' loads and free bytes change only when one of them takes
    # samples, which bumps ``version[j]``). Runs of one class (most of a large batch) then
    # recheck only the column that took the last sample, not every size.
    version = [0] * len(overhead)
    fail_cls, fail_at = -1, [-1] * len(overhead)
    # The earliest-finish rule's columns for the current class: (sorted groups, time, bytes,
    # overhead) of each column that can run it, rebuilt when the class changes (runs of a class).
    ef_cls: int = -1
    ef_cols: list[tuple[list[tuple[float, int, float]], float, float, float]] = []
    pos = 0
    for end in runs:
        while pos < end:
            c = ocls[pos]
            t_row, m_row = time_rows[c], mem_rows[c]
            gi, limit = -1, inf
            win_lo, win_hi = 0, SCAN  # where the chosen group's entry lies in its size's list
            if target_s is not None:
                ranked = col_order.get(c)
                if ranked is None:
                    ranked = sorted(cols, key=lambda j: (rank_rows[c][j], j))
                    col_order[c] = ranked
                if c != fail_cls or not remember_failures:
                    fail_cls, fail_at = c, [-1] * len(overhead)
                for j in ranked:
                    t = t_row[j]
                    if t == inf or fail_at[j] == version[j]:
                        continue
                    lst = by_load[j]
                    p = bisect_right(lst, (target_s - t, inf))
                    if not p:
                        fail_at[j] = version[j]
                        continue  # every group of this size is past the target already
                    m, o = m_row[j], overhead[j]
                    best_f = -inf
                    for ld, g, fr in reversed(lst[p - SCAN if p > SCAN else 0:p]):
                        if ld + t + o < best_f:
                            break  # lower loads cannot finish later
                        f = ld + t + (o if fr < m else 0.0)
                        if f <= target_s and (f > best_f or (f == best_f and g < gi)):
                            best_f, gi = f, g
                    if gi >= 0:
                        limit = target_s
                        win_lo, win_hi = (p - SCAN if p > SCAN else 0), p
                        break
                    fail_at[j] = version[j]
                if gi < 0 and strict:
                    return None
            if gi < 0:
                best1 = best2 = inf
                if c != ef_cls:
                    ef_cls, ef_cols = c, [(by_load[j], t_row[j], m_row[j], overhead[j])
                                          for j in cols if t_row[j] != inf]
                for lst, t, m, o in ef_cols:
                    ld = lst[0][0]
                    if ld + t > best2:
                        continue  # neither the best nor the second best here
                    stop = ld + o
                    for ld, g, fr in lst[:SCAN]:
                        x = ld + t
                        if x > best1 and x > best2:
                            break  # no group from here on can change best1 or best2
                        if ld > stop:
                            if x < best2:  # min() inlined: this loop is the hot path
                                best2 = x
                            break
                        f = x + o if fr < m else x
                        if f < best1 or (f == best1 and g < gi):
                            best1, best2, gi = f, (best2 if best2 < best1 else best1), g
                        elif f < best2:
                            best2 = f
                    else:
                        if len(lst) > SCAN and lst[SCAN][0] + t < best2:
                            best2 = lst[SCAN][0] + t
                if gi < 0:
                    return None
                if end - pos > 1 and len(groups) > 1:
                    limit = best2
            g_state = groups[gi]
            j = g_state.col
            ld, fr, o = load[gi], free[gi], overhead[j]
            time_c, mem_c = columns[j]
            old = (ld, gi, fr)
            first = True
            while pos < end:
                i = order[pos]
                ci = ocls[pos]
                t, m = time_c[ci], mem_c[ci]
                opens = fr < m
                nxt = ld + t + (o if opens else 0.0)
                if not first and (nxt > limit or t == inf):
                    break
                first = False
                if opens:
                    fr = budget - m
                    g_state.mbs.append([i])
                    g_state.free_bytes.append(fr)
                else:
                    fr -= m
                    g_state.mbs[-1].append(i)
                    g_state.free_bytes[-1] = fr
                ld = nxt
                pos += 1
            load[gi], free[gi] = ld, fr
            version[j] += 1
            lst = by_load[j]
            # The entry is within the window the choice scanned (a bisection over those few
            # entries, not the whole list); a load that grew sorts after the old position.
            at = bisect_left(lst, old, win_lo, win_hi if win_hi < len(lst) else len(lst))
            if at == len(lst) or lst[at] != old:  # not where the scan saw it: search it all
                at = bisect_left(lst, old)
            del lst[at]
            insort(lst, (ld, gi, fr), at if ld > old[0] else 0)
    for gi, state in enumerate(groups):
        state.load_s = float(load[gi])
    return groups
