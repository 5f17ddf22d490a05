"""What the planner checks before it returns a plan: the lower bound under the plan (two-sided, its
rule in ``planner.bounds.check``), every micro-batch in memory and every policy in range (a failed
check is a bug, raised loudly with the batch's digest)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from costmodel.evaluate import CostModel
from costmodel.specs import Sample
from planner.assemble import BatchArrays, Draft, draft_problems
from planner.bounds.check import (  # noqa: F401  (re-exported: the bound's rule lives with the bounds)
    BOUND_REL_TOL,
    BoundError,
    check_bound,
)

logger = logging.getLogger(__name__)


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


def batch_digest(samples: Sequence[Sample]) -> str:
    """SHA-256 of the batch's ids and shapes in order: names a batch in logs (to replay it)."""
    text = "\n".join(f"{s.id}:{s.tokens}:{s.frames}:{s.height}:{s.width}" for s in samples)
    return hashlib.sha256(text.encode()).hexdigest()
