"""The run-time rule every reported lower bound obeys, two-sided.

A lower bound of a valid plan must not exceed the plan's step time; it must stay below it unless
CP-SAT proved the plan optimal (status ``OPTIMAL``) or, for a simple bound, the plan's own shape
shows why they meet (no idle rank, or a slowest group of one sample); and only an ``OPTIMAL``
plan may carry the kind ``cpsat-optimal``. ``planner.planning`` applies it to every bound it computes (raising
``BoundError``, or dropping the bound in the service's jobs) and ``planner.validate`` to every
plan it checks, so a bound set to the plan's own time, or a proof claimed by a heuristic, fails
as loudly as a bound above the plan.
"""

from __future__ import annotations

import logging

from planner.plan import Plan

logger = logging.getLogger(__name__)


BOUND_REL_TOL = 1e-9
"""Relative slack for floating-point summation order when a bound is checked against a plan."""


class BoundError(RuntimeError):
    """A lower bound above the step time of a valid plan, or equal to it without a proof of
    optimality, or labelled ``cpsat-optimal`` without CP-SAT's proof: the bound is wrong (a bug)."""


PROVEN_STATUS = "OPTIMAL"
"""The plan status that comes with a proof of optimality (CP-SAT's own)."""

WITNESSED_KINDS = frozenset({"longest", "area", "deadline-area", "largest-choice"})
"""The simple bounds a plan nothing proved optimal may meet, when the plan itself shows why
(:func:`plan_witnesses_tie`). Every other kind never may: the partition LP and the pattern bound
report a deadline they proved infeasible (less a margin), so they stay strictly below every plan;
CP-SAT's objective bound meets a plan only with its proof."""


def plan_witnesses_tie(plan: Plan) -> bool:
    """Whether the plan's own shape shows a simple bound can meet its step time: no rank idles
    (every group computes for the whole makespan, as an area-type bound needs to be tight), or its
    slowest group runs one sample in one micro-batch (as ``longest`` needs). On the shipped
    presets the simple bounds stay 0.4-5% under even a one-sample plan; a batch of equal samples
    that divides evenly over equal groups is where they meet it."""
    times = [g.predicted_time_s for g in plan.groups]
    makespan = max(times)
    if min(times) >= makespan * (1 - BOUND_REL_TOL) and sum(g.size for g in plan.groups) == plan.num_ranks:
        return True
    slowest = max(plan.groups, key=lambda g: g.predicted_time_s)
    return len(slowest.micro_batches) == 1 and len(slowest.micro_batches[0].samples) == 1


def bound_problem(bound_s: float, kind: str, plan_step_time_s: float, *, status: str,
                  tie_witnessed: bool = False) -> str | None:
    """What is wrong with a lower bound of a valid plan of ``status``, or None.

    Two-sided: the bound must not exceed the plan's step time (by more than ``BOUND_REL_TOL``,
    for summation order); it must stay below it (by more than ``BOUND_REL_TOL``) unless the plan
    is ``OPTIMAL``, or the bound is a simple one (:data:`WITNESSED_KINDS`) and
    ``tie_witnessed`` (:func:`plan_witnesses_tie`); and the kind ``cpsat-optimal`` belongs to
    ``OPTIMAL`` plans alone.
    """
    if not bound_s <= plan_step_time_s * (1 + BOUND_REL_TOL):  # (a NaN bound is wrong too)
        return (f"lower bound {kind!r} = {bound_s:.9g} s exceeds the step time "
                f"{plan_step_time_s:.9g} s of a valid plan: the bound is wrong")
    if status == PROVEN_STATUS:
        return None
    if kind == "cpsat-optimal":
        return (f"lower bound 'cpsat-optimal' on a {status} plan: only CP-SAT's proof of optimality "
                "(status OPTIMAL) makes the plan's own time a bound")
    if bound_s >= plan_step_time_s * (1 - BOUND_REL_TOL) and not (tie_witnessed and kind in WITNESSED_KINDS):
        return (f"lower bound {kind!r} = {bound_s:.9g} s equals the step time {plan_step_time_s:.9g} s "
                f"of a {status} plan, which nothing proved optimal: the bound is wrong")
    return None


def check_bound(bound_s: float, kind: str, plan_step_time_s: float, *, status: str,
                tie_witnessed: bool = False) -> None:
    """Refuse a wrong lower bound of a valid plan of ``status`` (:func:`bound_problem`).

    Raises:
        BoundError: naming the bound's kind and both values; logged at ERROR first.
    """
    message = bound_problem(bound_s, kind, plan_step_time_s, status=status, tie_witnessed=tie_witnessed)
    if message is not None:
        logger.error(message)
        raise BoundError(message)
