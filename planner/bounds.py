"""Lower bounds of the step time (DESIGN.md, 'Lower bound').

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

Every bound adds the gradient sync, which every step pays after its slowest group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.costs import CostTable


@dataclass(frozen=True, slots=True)
class BoundReport:
    """All bounds of one batch, seconds, gradient sync included."""

    longest_s: float
    area_s: float
    deadline_area_s: float
    compute_makespan_s: float
    """The deadline-area bound without the gradient sync (the ``T`` that solves it)."""

    @property
    def best_s(self) -> float:
        """The tightest bound."""
        return max(self.longest_s, self.area_s, self.deadline_area_s)

    @property
    def best_kind(self) -> str:
        """Name of the tightest bound (ties: the most specific name)."""
        best = self.best_s
        if self.deadline_area_s >= best:
            return "deadline-area"
        if self.longest_s >= best:
            return "longest"
        return "area"


def _area_at(table: CostTable, counts: np.ndarray, deadline: float) -> float:
    """``sum_i a_i(deadline)``: each class at its most efficient size meeting the deadline."""
    sizes = np.asarray(table.sizes, dtype=np.float64)
    area = table.time_s * sizes[None, :]
    ok = table.time_s + table.overhead_s <= deadline * (1 + 1e-12)
    best = np.where(ok, area, np.inf).min(axis=1)
    return float((best * counts).sum())


def lower_bounds(table: CostTable) -> BoundReport:
    """Compute every bound of DESIGN.md for the batch of a cost table."""
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    n = float(table.cost_model.cluster.num_gpus)
    o = table.overhead_s
    sync = table.grad_sync_s
    sizes = np.asarray(table.sizes, dtype=np.float64)
    fastest = table.time_s.min(axis=1)
    longest = float(fastest.max()) + o
    area_work = float((np.min(table.time_s * sizes[None, :], axis=1) * counts).sum())
    area = area_work / n + o
    # Deadline-area: the breakpoints are the finite t_i(d) + o at or above ``longest``.
    points = np.unique((table.time_s + o)[np.isfinite(table.time_s)])
    points = points[points >= longest * (1 - 1e-12)]
    if points.size == 0 or points[0] > longest:
        points = np.concatenate(([longest], points))

    def satisfied(deadline: float) -> bool:
        return _area_at(table, counts, deadline) <= n * (deadline - o) * (1 + 1e-12)

    # The smallest breakpoint index whose interval [p_k, p_{k+1}) holds the solution.
    lo, hi = 0, len(points) - 1
    if satisfied(points[0]):
        makespan = float(points[0])
    else:
        # Find the last breakpoint k where f(p_k)/n + o > p_k (not satisfied at p_k itself).
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if satisfied(float(points[mid])):
                hi = mid - 1
            else:
                lo = mid
        k = lo
        work = _area_at(table, counts, float(points[k]))
        candidate = work / n + o
        upper = float(points[k + 1]) if k + 1 < len(points) else np.inf
        makespan = min(max(candidate, float(points[k])), upper)
    return BoundReport(longest_s=longest + sync, area_s=area + sync,
                       deadline_area_s=makespan + sync, compute_makespan_s=makespan)
