"""What the planner checks before it returns a plan: the lower bound under the plan, every micro-batch
in memory and every policy in range (a failed check is a bug, raised loudly with the batch's digest)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from costmodel.evaluate import CostModel
from costmodel.specs import Sample
from planner.assemble import BatchArrays, Draft, draft_problems

logger = logging.getLogger(__name__)


BOUND_REL_TOL = 1e-9
"""Relative slack for floating-point summation order when a bound is checked against a plan."""


class BoundError(RuntimeError):
    """A lower bound above the step time of a valid plan: the bound is wrong (a bug)."""


class InvalidPlanError(RuntimeError):
    """A plan (the planner's own or a baseline's) that cannot run: a checkpoint policy out of range
    or a micro-batch over the memory limit (a bug: every candidate is built to fit)."""


def check_draft(draft: Draft, arrays: BatchArrays, cost_model: CostModel, *, limit_bytes: float, what: str,
                samples: Sequence[Sample]) -> None:
    """Refuse a draft that cannot run (``planner.assemble.draft_problems``).

    Raises:
        InvalidPlanError: naming ``what`` (the plan or the baseline), the problems and the batch's
            digest; logged at ERROR first.
    """
    problems = draft_problems(draft, arrays, cost_model, limit_bytes=limit_bytes)
    if problems:
        message = (f"{what} cannot run (batch {batch_digest(samples)}, {len(samples)} samples): "
                   + "; ".join(problems))
        logger.error(message)
        raise InvalidPlanError(message)


def check_bound(bound_s: float, kind: str, plan_step_time_s: float) -> None:
    """Refuse a lower bound above a valid plan's predicted step time.

    Raises:
        BoundError: naming the bound's kind and both values; logged at ERROR first.
    """
    if bound_s > plan_step_time_s * (1 + BOUND_REL_TOL):
        message = (f"lower bound {kind!r} = {bound_s:.9g} s exceeds the step time "
                   f"{plan_step_time_s:.9g} s of a valid plan: the bound is wrong")
        logger.error(message)
        raise BoundError(message)


def batch_digest(samples: Sequence[Sample]) -> str:
    """SHA-256 of the batch's ids and shapes in order: names a batch in logs (to replay it)."""
    text = "\n".join(f"{s.id}:{s.tokens}:{s.frames}:{s.height}:{s.width}" for s in samples)
    return hashlib.sha256(text.encode()).hexdigest()
