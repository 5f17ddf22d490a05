"""What the pictures show, without matplotlib: an epoch's per-step figures and their summary,
and the inputs of a plan's Gantt chart (so the service imports matplotlib only to draw)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from costmodel.evaluate import CostModel
from planner.baselines import NOT_HEADLINE, strongest
from planner.plan import Plan

ImageFormat = Literal["png", "svg"]
"""Formats the report writes."""

FORMATS: tuple[ImageFormat, ...] = ("png", "svg")

MEDIA_TYPES: dict[str, str] = {"png": "image/png", "svg": "image/svg+xml"}
"""Media type of each format."""


STRONGEST = "strongest"
"""The per-step fastest baseline but ``naive`` (``planner.baselines.strongest``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFigures:
    """What one stored plan says about its step."""

    step: int
    """Step index."""
    predicted_step_time_s: float
    """The plan's predicted step time."""
    lower_bound_s: float
    """Its lower bound."""
    bound_kind: str
    """Which bound."""
    status: str
    """Solver status."""
    baselines_s: Mapping[str, float] = field(default_factory=dict)
    """Each baseline's predicted step time."""
    planning_wall_s: float | None = None
    """How long the planner took for this step (its wall clock)."""
    num_tokens: int = 0
    """Tokens of the step's samples."""

    @classmethod
    def of_plan(cls, plan: Mapping[str, Any]) -> StepFigures:
        """From a plan's JSON object (``planner.plan.Plan`` as stored)."""
        tokens = (int(plan["num_tokens"]) if "num_tokens" in plan else  # the store's projection
                  sum(int(ps["sample"]["tokens"]) for g in plan["groups"] for mb in g["micro_batches"]
                      for ps in mb["samples"]))
        return cls(step=int(plan["step"] or 0), predicted_step_time_s=float(plan["predicted_step_time_s"]),
                   lower_bound_s=float(plan["lower_bound"]["value_s"]),
                   bound_kind=str(plan["lower_bound"]["kind"]), status=str(plan["solver"]["status"]),
                   baselines_s={str(k): float(v) for k, v in plan.get("baselines_s", {}).items()},
                   planning_wall_s=plan["solver"].get("wall_time_s"), num_tokens=tokens)

    @property
    def predicted_tokens_per_s(self) -> float:
        """Tokens of the step over its predicted time: the whole world's training throughput."""
        return self.num_tokens / self.predicted_step_time_s if self.predicted_step_time_s > 0 else 0.0

    @property
    def gap(self) -> float:
        """``predicted / bound - 1`` (0 without a bound)."""
        return self.predicted_step_time_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else 0.0

    def speedups(self) -> dict[str, float]:
        """Baseline time / plan time for each baseline, and ``strongest``."""
        t = self.predicted_step_time_s
        out = {name: b / t for name, b in self.baselines_s.items()} if t > 0 else {}
        best = strongest(self.baselines_s)
        if best is not None and t > 0:
            out[STRONGEST] = best[1] / t
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StepError:
    """A step's predictions against what its ranks measured (per micro-batch, then averaged)."""

    step: int
    """Step index."""
    num_micro_batches: int
    """Measured micro-batches of the step (one per group and micro-batch)."""
    mape: float
    """Mean ``|predicted - measured| / measured``."""
    mean_ratio: float
    """Mean ``predicted / measured`` (below 1: the model predicts too fast)."""

    @classmethod
    def of_pairs(cls, step: int, pairs: Sequence[tuple[float, float]]) -> StepError:
        """From ``(predicted, measured)`` seconds of each measured micro-batch.

        Raises:
            ValueError: without a pair, or for a measured time that is not positive.
        """
        if not pairs or any(m <= 0 for _, m in pairs):
            raise ValueError(f"step {step}: prediction errors need positive measured times, got {list(pairs)[:3]}")
        return cls(step=step, num_micro_batches=len(pairs),
                   mape=sum(abs(p - m) / m for p, m in pairs) / len(pairs),
                   mean_ratio=sum(p / m for p, m in pairs) / len(pairs))


@dataclass(frozen=True, kw_only=True, slots=True)
class BaselineSummary:
    """One baseline over the stored steps."""

    name: str
    """Baseline name (or ``strongest``)."""
    num_steps: int
    """Steps where it was computed."""
    total_speedup: float
    """Its total time over those steps / the plans' total: the throughput gain."""
    mean_speedup: float
    """Mean per-step speedup."""
    min_speedup: float
    """Lowest per-step speedup."""
    max_speedup: float
    """Highest per-step speedup."""


def summarise(steps: Sequence[StepFigures]) -> list[BaselineSummary]:
    """Per baseline (``strongest`` first, ``naive`` last): speedups over the steps."""
    names = sorted({n for s in steps for n in s.speedups()},
                   key=lambda n: (n != STRONGEST, n in NOT_HEADLINE, n))
    out = []
    for name in names:
        rows = [s for s in steps if name in s.speedups()]
        per_step = [s.speedups()[name] for s in rows]
        base_total = sum(s.predicted_step_time_s * s.speedups()[name] for s in rows)
        plan_total = sum(s.predicted_step_time_s for s in rows)
        out.append(BaselineSummary(name=name, num_steps=len(rows),
                                   total_speedup=base_total / plan_total if plan_total > 0 else math.nan,
                                   mean_speedup=sum(per_step) / len(per_step),
                                   min_speedup=min(per_step), max_speedup=max(per_step)))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanPictureInput:
    """What a plan's Gantt chart shows."""

    plan: Plan
    """The planner's plan."""
    cost_model: CostModel
    """The cost model it was made with, bound to its cluster."""
    baseline: Plan | None = None
    """The strongest baseline's plan of the same batch (``planner.baseline_plan``), if any."""
    label: str = ""
    """What the step is (e.g. ``epoch e0, step 3``), for the title."""
