"""What a Ray task of an epoch job receives and runs (imported by Ray's workers; no Ray import).

``api.ray_runner`` puts one :class:`SharedInputs` per job in the object store and sends
``plan_step_batch(shared_ref, [(step, samples JSON), ...])`` tasks; each step is planned by the
same ``planner.epoch.plan_step`` as in the process pool, so the bytes and digests are the same.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from planner.epoch import StepResult, StepTask, plan_step


@dataclass(kw_only=True, frozen=True, slots=True)
class SharedInputs:
    """What every step of a job shares: put in the object store once per job."""

    cluster_json: str
    """The world (``ClusterSpec`` JSON)."""
    cost_model_json: str
    """The cost model (``CostModelFile`` JSON)."""
    options_json: str
    """PlannerConfig fields as JSON."""
    seed: int
    """Job seed (each step gets ``step_seed(seed, step)``)."""
    deadline_s: float | None
    """Wall-clock deadline of one step (None: none)."""


def plan_step_batch(shared: SharedInputs, steps: Sequence[tuple[int, str]]) -> list[StepResult | Exception]:
    """Plan a batch of steps (runs in a Ray worker); a failed step gives its exception.

    Args:
        shared: The job's inputs (resolved from the object store by Ray).
        steps: ``(step, samples JSON)`` pairs.
    """
    from api.pool import run_with_deadline

    options = json.loads(shared.options_json)
    # SIGALRM deadlines need the main thread (where Ray runs plain tasks).
    use_alarm = shared.deadline_s is not None and threading.current_thread() is threading.main_thread()
    out: list[StepResult | Exception] = []
    for step, samples_json in steps:
        task = StepTask(step=step, samples_json=samples_json, cluster_json=shared.cluster_json,
                        cost_model_json=shared.cost_model_json, options=options, seed=shared.seed)
        try:
            if use_alarm:
                assert shared.deadline_s is not None
                out.append(run_with_deadline(shared.deadline_s, plan_step, task))
            else:
                out.append(plan_step(task))
        except Exception as exc:
            out.append(exc)
    return out
