"""Lower bounds of the step time (docs/design.md, 'Lower bounds').

Notation: ``t_i(d)`` is sample ``i``'s time on a group of size ``d`` under the cheapest policy
that lets it fit a micro-batch on its own (any plan runs it with at least that policy, since
other samples in its micro-batch only add memory); ``o`` is the per-micro-batch overhead.

* ``longest``: some group runs sample ``i`` in a micro-batch, so ``T >= min_d t_i(d) + o``.
* ``area``: a rank whose group has work pays ``o`` at least once, so the busy GPU-seconds obey
  ``sum_i min_d d*t_i(d) <= N*(T - o)``.
* ``deadline-area`` (what plans report; it implies both): in a plan with compute makespan
  ``T`` every sample runs on a size with ``t_i(d) + o <= T``, so its GPU-seconds are at least
  ``a_i(T) = min {d*t_i(d) : t_i(d) + o <= T}``, and ``sum_i a_i(T) <= N*(T - o)``. The left
  side falls and the right side rises with ``T``; the smallest ``T`` that satisfies it is a
  bound. It is the bound "per choice of the largest sample's group size", for all samples at
  once.

* ``largest-choice`` (tighter when one huge sample dominates): for each size ``d*`` the
  longest sample may run on, every other sample runs either after it in the same group (in
  series: their times ``t_i(d*)`` fill at most ``T - o - t*(d*)``) or on the other ``N - d*``
  ranks (groups of size at most ``N - d*``, GPU-seconds at least ``a_i(T)`` over those sizes,
  at most ``(N - d*)(T - o)`` in all). The best split is a knapsack; its fractional (LP)
  relaxation over-estimates what the big group can take off the others, so the smallest ``T``
  that passes the relaxed test is a bound for that ``d*``; the minimum over ``d*`` is a bound.
  The same argument runs over the sizes of the two longest samples (in one group, one after
  the other, or in two groups; others in a big group take at least their time on the fastest
  big-group size, against the big groups' total leftover time) and the minimum over all those
  choices is reported.

Every bound adds the gradient sync, which every step pays after its slowest group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.bounds.bisect import threshold
from planner.costs import CostTable


@dataclass(frozen=True, slots=True)
class BoundReport:
    """All bounds of one batch, seconds, gradient sync included."""

    longest_s: float
    area_s: float
    deadline_area_s: float
    largest_choice_s: float
    compute_makespan_s: float
    """The tightest bound without the gradient sync."""

    @property
    def best_s(self) -> float:
        """The tightest bound."""
        return max(self.longest_s, self.area_s, self.deadline_area_s, self.largest_choice_s)

    @property
    def best_kind(self) -> str:
        """Name of the tightest bound (ties: the most specific name)."""
        best = self.best_s
        if self.largest_choice_s >= best and self.largest_choice_s > self.deadline_area_s:
            return "largest-choice"
        if self.deadline_area_s >= best:
            return "deadline-area"
        if self.longest_s >= best:
            return "longest"
        return "area"


def _area_at(time_o_t: np.ndarray, area_t: np.ndarray, counts: np.ndarray,
             deadline: float) -> float:
    """``sum_i a_i(deadline)``: each class at its most efficient size meeting the deadline.

    ``time_o_t`` (time plus overhead) and ``area_t`` are size x class, C-contiguous: the
    minimum over sizes is then a reduction of whole rows (a few times faster than along a
    short last axis; the same minimum).
    """
    best = np.where(time_o_t <= deadline * (1 + 1e-12), area_t, np.inf).min(axis=0)
    return float((best * counts).sum())


def _solve_deadline(time_s: np.ndarray, area: np.ndarray, counts: np.ndarray, *, num_ranks: float,
                    overhead_s: float, reserved_area: float, floor_s: float) -> float:
    """Smallest ``T >= floor_s`` with ``sum a_i(T) + reserved <= num_ranks*(T - o)``."""
    o = overhead_s
    points = np.unique((time_s + o)[np.isfinite(time_s)])
    points = points[points > floor_s]
    points = np.concatenate(([floor_s], points))

    time_o_t = np.ascontiguousarray((time_s + o).T)
    area_t = np.ascontiguousarray(area.T)

    def work(deadline: float) -> float:
        return _area_at(time_o_t, area_t, counts, deadline) + reserved_area

    def satisfied(deadline: float) -> bool:
        return work(deadline) <= num_ranks * (deadline - o) * (1 + 1e-12)

    if satisfied(float(points[0])):
        return float(points[0])
    lo, hi = 0, len(points) - 1
    while lo < hi:  # the last breakpoint where the inequality fails
        mid = (lo + hi + 1) // 2
        if satisfied(float(points[mid])):
            hi = mid - 1
        else:
            lo = mid
    candidate = work(float(points[lo])) / num_ranks + o
    upper = float(points[lo + 1]) if lo + 1 < len(points) else np.inf
    return min(max(candidate, float(points[lo])), upper)


def _big_groups_bound(time_s: np.ndarray, sizes: np.ndarray, others: np.ndarray, *,
                      num_ranks: float, overhead_s: float, groups: list[tuple[int, float]],
                      floor_s: float, upper_s: float, iterations: int = 40) -> float:
    """The largest-choice bound for fixed groups of the largest samples (bisection on ``T``).

    Args:
        groups: ``(size column, seconds of the large samples in it)`` per group that holds
            one or two of the largest samples.
    """
    o = overhead_s
    rest_ranks = num_ranks - sum(float(sizes[j]) for j, _ in groups)
    if rest_ranks < 0:
        return np.inf
    busy = sum(t for _, t in groups)
    # Others placed in a big group take at least their time on the fastest of those sizes.
    t_big = time_s[:, [j for j, _ in groups]].min(axis=1)
    rest_ok = sizes <= rest_ranks
    active = others > 0
    slack_floor = max(t for _, t in groups) + o
    # The same arrays at every deadline of the bisection: time plus overhead on the sizes the
    # other ranks can form (NaN elsewhere: never <= a deadline), GPU-seconds, and the big-group
    # seconds of each class (read only where t_big is finite and the class has samples).
    # Sizes along the first axis: the minimum over sizes is then a reduction of whole rows (a
    # few times faster than along a short last axis; the same minimum).
    time_o_rest = np.ascontiguousarray(np.where(rest_ok[None, :], time_s + o, np.nan).T)
    area = np.ascontiguousarray((time_s * sizes[None, :]).T)
    big_bad = ~np.isfinite(t_big)
    big_ok = ~big_bad & (t_big > 0)
    with np.errstate(invalid="ignore"):
        big_s = t_big * others

    def feasible(deadline: float) -> bool:
        if deadline < slack_floor:
            return False
        cap = len(groups) * (deadline - o) - busy  # time left in the big groups, in all
        a_rest = np.where(time_o_rest <= deadline, area, np.inf).min(axis=0)
        # Classes that cannot run on the other ranks must all go into the big groups.
        forced = active & ~np.isfinite(a_rest)
        if (forced & big_bad).any():
            return False
        cap -= float(big_s[forced].sum())
        if cap < 0:
            return False
        free = active & ~forced
        need = float((a_rest[free] * others[free]).sum())
        # Fractional knapsack: relieve the most GPU-seconds per second of big-group time.
        movable = np.flatnonzero(free & big_ok)
        relief = 0.0
        if movable.size and cap > 0:
            ratio = a_rest[movable] / t_big[movable]
            pick = movable[np.argsort(-ratio, kind="stable")]
            weight = big_s[pick]  # big-group seconds of each whole class
            value = a_rest[pick] * others[pick]
            filled = np.cumsum(weight)
            whole = int(np.searchsorted(filled, cap, side="right"))
            relief = float(value[:whole].sum())
            if whole < pick.size:
                used = float(filled[whole - 1]) if whole else 0.0
                relief += float(value[whole]) * (cap - used) / float(weight[whole])
        return need - relief <= rest_ranks * (deadline - o) * (1 + 1e-12)

    lo, hi = max(floor_s, slack_floor), upper_s
    if feasible(lo):
        return lo
    if not feasible(hi):
        return hi  # cannot happen for a plannable batch; a safe (loose) value
    return threshold(feasible, lo, hi, iterations, rel_tol=2e-4)[0]


def _min_over(configs: list[tuple[float, list[tuple[int, float]], np.ndarray]],
              table: CostTable, *, floor_s: float, upper_s: float) -> float:
    """Min of the big-groups bound over configurations (cheapest-looking first, pruned)."""
    sizes = np.asarray(table.sizes, dtype=np.float64)
    n = float(table.cost_model.cluster.num_gpus)
    o = table.overhead_s
    best = np.inf
    for floor, groups, left in sorted(configs, key=lambda item: item[0]):
        if floor + o >= best:
            break  # every remaining configuration starts above the best bound so far
        value = _big_groups_bound(table.time_s, sizes, left, num_ranks=n, overhead_s=o,
                                  groups=groups, floor_s=floor_s, upper_s=upper_s)
        best = min(best, value)
    return best


def _largest_choice(table: CostTable, counts: np.ndarray, *, floor_s: float, upper_s: float,
                    pair_threshold_s: float) -> tuple[float, float]:
    """The largest-choice bounds: over the sizes of the longest sample, and over the sizes of
    the two longest (sharing a group or not; only when the second takes at least
    ``pair_threshold_s`` on its fastest size, else inf). Each is a min over a complete set of
    configurations, so each is a bound on its own."""
    time_s = table.time_s
    fastest = time_s.min(axis=1)
    order = np.argsort(-fastest, kind="stable")
    first = int(order[0])
    others = counts.copy()
    others[first] -= 1
    cols = [j for j in range(len(table.sizes)) if np.isfinite(time_s[first, j])]
    singles = [(float(time_s[first, j]), [(j, float(time_s[first, j]))], others) for j in cols]
    single = _min_over(singles, table, floor_s=floor_s, upper_s=upper_s)
    if counts.sum() < 2 or single <= floor_s * (1 + 1e-3):
        return single, np.inf  # (the second case: the longest sample does not bind; skip)
    second = first if others[first] > 0 else int(order[1])
    if fastest[second] < pair_threshold_s:
        return single, np.inf
    rest = others.copy()
    rest[second] -= 1
    pairs: list[tuple[float, list[tuple[int, float]], np.ndarray]] = []
    for j1 in cols:
        t1 = float(time_s[first, j1])
        for j2 in range(len(table.sizes)):
            t2 = float(time_s[second, j2])
            if not np.isfinite(t2):
                continue
            if j2 == j1:  # both in one group, one after the other
                pairs.append((t1 + t2, [(j1, t1 + t2)], rest))
            pairs.append((max(t1, t2), [(j1, t1), (j2, t2)], rest))
    return single, _min_over(pairs, table, floor_s=floor_s, upper_s=upper_s)


def lower_bounds(table: CostTable) -> BoundReport:
    """Compute every bound of the module docstring for the batch of a cost table."""
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    n = float(table.cost_model.cluster.num_gpus)
    o = table.overhead_s
    sync = table.grad_sync_s
    sizes = np.asarray(table.sizes, dtype=np.float64)
    area = table.time_s * sizes[None, :]
    fastest = table.time_s.min(axis=1)
    longest = float(fastest.max()) + o
    area_work = float((np.min(area, axis=1) * counts).sum())
    area_bound = area_work / n + o
    deadline = _solve_deadline(table.time_s, area, counts, num_ranks=n, overhead_s=o,
                               reserved_area=0.0, floor_s=longest)
    # Largest-choice: the longest sample (and the two longest) on each size.
    upper = max(deadline, longest) * 4 + 1.0
    single, pair = _largest_choice(table, counts, floor_s=max(longest, deadline), upper_s=upper,
                                   pair_threshold_s=0.25 * deadline)
    best_choice = max(single, pair if np.isfinite(pair) else single)
    choice = max(best_choice, deadline) if np.isfinite(best_choice) else deadline
    return BoundReport(longest_s=longest + sync, area_s=area_bound + sync,
                       deadline_area_s=deadline + sync, largest_choice_s=choice + sync,
                       compute_makespan_s=max(deadline, choice))
