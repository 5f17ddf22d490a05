"""Bisection on a deadline for the relaxation bounds (``planner.bounds.lp``, ``planner.bounds.patterns``).

Each bound is the largest compute makespan at which a relaxation of every plan is proven
infeasible. Feasibility is monotone in the deadline, so a bracket found by probing upward from a
known bound, then a bisection inside it, finds the threshold; no plan's time enters.
"""

from __future__ import annotations

from collections.abc import Callable

BRACKET_FIRST_STEP = 0.01
"""The first probe above the known bound is ``lower * (1 + 0.01)``; each further one doubles the
step (1.02, 1.04, 1.08, ...) until the relaxation is feasible."""

BRACKET_MAX_FACTOR = 64.0
"""Probing stops at ``lower * 64``: a relaxation still infeasible there returns that deadline, which a
plan's step time then contradicts (``BoundError``) unless the plan is that slow."""


def feasible_bracket(feasible: Callable[[float], bool], lower_s: float) -> tuple[float, float]:
    """``(lo, hi)`` with ``lo`` proven infeasible (or ``lower_s``) and ``hi`` feasible, found by
    probing upward from ``lower_s`` alone: the bracket comes from the problem, never from a plan's
    time (a bracket capped by the plan would turn a relaxation that is wrongly infeasible everywhere into
    a bound equal to the plan, a gap of 0 that reveals nothing). ``hi`` is ``inf`` when nothing up
    to :data:`BRACKET_MAX_FACTOR` times ``lower_s`` is feasible."""
    lo, step = lower_s, BRACKET_FIRST_STEP
    while step <= BRACKET_MAX_FACTOR:
        probe = lower_s * (1 + step)
        if feasible(probe):
            return lo, probe
        lo, step = probe, step * 2
    return lo, float("inf")



def threshold(feasible: Callable[[float], bool], lo: float, hi: float, iterations: int, *,
              rel_tol: float = 0.0) -> tuple[float, float]:
    """Bisection between an infeasible ``lo`` and a feasible ``hi``: the last pair (after
    ``iterations`` steps, or earlier once ``hi - lo <= rel_tol * hi``)."""
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= rel_tol * hi:
            break
    return lo, hi
