"""Offline epoch precompute: manifest + global batch rule + seed -> one plan per step.

Shared by ``dcp epoch`` and the service's epoch jobs. The steps of an epoch are decided here,
before any planning, and never changed by a plan: the manifest is shuffled with the job seed
and cut into global batches by the batch rule (``samples_per_step`` or ``tokens_per_step``);
the last batch keeps whatever is left (no sample is dropped). Each step is planned
independently with a seed derived from the job seed and the step, on a process pool; results
are handed to a sink (the plan store) in small transactions, so a job interrupted at any
point resumes from the stored steps and ends with the same plans as an uninterrupted run.

Determinism: a plan is a pure function of (samples, cluster, cost model, options, step seed)
when the planner runs with a deterministic budget. Wall-clock fields of the plan
(``solver.wall_time_s``) are the only parts that vary between runs; ``canonical_step_plan``
zeroes them before the plan is stored so that the stored bytes and the digest are identical
across runs and resumes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.baselines import strongest
from planner.plan import Plan

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.5
"""Longest time a finished step waits in memory before it is written."""


@dataclass(kw_only=True, frozen=True, slots=True)
class BatchRule:
    """How the shuffled manifest is cut into global batches (exactly one field is set)."""

    samples_per_step: int | None = None
    """Samples per step (the last step may hold fewer)."""
    tokens_per_step: int | None = None
    """Token budget per step: a step takes samples in order while the sum stays within it."""

    def __post_init__(self) -> None:
        if (self.samples_per_step is None) == (self.tokens_per_step is None):
            raise ValueError("a batch rule sets exactly one of samples_per_step and tokens_per_step, "
                             f"got samples_per_step={self.samples_per_step}, "
                             f"tokens_per_step={self.tokens_per_step}")
        for name in ("samples_per_step", "tokens_per_step"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    def as_dict(self) -> dict[str, int]:
        """The set field as a dict (the wire form)."""
        if self.samples_per_step is not None:
            return {"samples_per_step": self.samples_per_step}
        assert self.tokens_per_step is not None
        return {"tokens_per_step": self.tokens_per_step}


def step_seed(seed: int, step: int) -> int:
    """The planner seed of one step: a 31-bit hash of the job seed and the step index."""
    digest = hashlib.sha256(f"dcp-epoch:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def make_steps(samples: Sequence[Sample], *, rule: BatchRule, seed: int) -> list[list[Sample]]:
    """Cut a manifest into the global batches of an epoch.

    Args:
        samples: The manifest (unique ids).
        rule: Samples or tokens per step.
        seed: Shuffle seed; the same manifest, rule and seed always give the same steps.

    Returns:
        One list of samples per step; together they hold every sample exactly once.

    Raises:
        ValueError: for an empty manifest, or a sample longer than ``tokens_per_step``.
    """
    if not samples:
        raise ValueError("the manifest holds no samples")
    order = np.random.default_rng(seed).permutation(len(samples))
    shuffled = [samples[int(i)] for i in order]
    if rule.samples_per_step is not None:
        n = rule.samples_per_step
        return [shuffled[i:i + n] for i in range(0, len(shuffled), n)]
    budget = rule.tokens_per_step
    assert budget is not None
    steps: list[list[Sample]] = []
    current: list[Sample] = []
    current_tokens = 0
    for sample in shuffled:
        if sample.tokens > budget:
            raise ValueError(f"sample {sample.id!r} has {sample.tokens} tokens, more than "
                             f"tokens_per_step={budget}")
        if current and current_tokens + sample.tokens > budget:
            steps.append(current)
            current, current_tokens = [], 0
        current.append(sample)
        current_tokens += sample.tokens
    if current:
        steps.append(current)
    return steps


@dataclass(kw_only=True, frozen=True, slots=True)
class StepTask:
    """One step to plan, sent to a worker process as JSON text (cheap to pickle; the worker
    parses it, caching the cluster and cost model it sees again and again)."""

    step: int
    """Step index in the epoch."""
    samples_json: str
    """The step's global batch: a JSON list of samples."""
    cluster_json: str
    """The world (``ClusterSpec`` JSON)."""
    cost_model_json: str
    """The cost model (``CostModelFile`` JSON)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """PlannerConfig fields (``seed`` is replaced by the step seed)."""
    seed: int = 0
    """Job seed; the planner gets ``step_seed(seed, step)``."""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")

    @classmethod
    def create(cls, *, step: int, samples: Sequence[Sample], cluster: ClusterSpec,
               cost_model: CostModelFile, options: Mapping[str, Any] | None = None,
               seed: int = 0) -> StepTask:
        """A task from domain objects."""
        if not samples:
            raise ValueError(f"step {step} has no samples")
        return cls(step=step, samples_json=json.dumps([s.model_dump(exclude_none=True) for s in samples]),
                   cluster_json=cluster.model_dump_json(), cost_model_json=cost_model.model_dump_json(),
                   options=dict(options or {}), seed=seed)


@functools.lru_cache(maxsize=8)
def _cluster(text: str) -> ClusterSpec:
    return ClusterSpec.model_validate_json(text)


@functools.lru_cache(maxsize=8)
def _cost_model(text: str) -> CostModelFile:
    return CostModelFile.model_validate_json(text)


@dataclass(kw_only=True, frozen=True, slots=True)
class StepResult:
    """A planned step, ready to store."""

    step: int | None
    """Step index (None for a plan outside an epoch)."""
    plan_json: str
    """Canonical JSON of the plan (the bytes the digest covers)."""
    digest: str
    """SHA-256 of ``plan_json``."""
    gap: float
    """predicted / lower bound - 1."""
    predicted_step_time_s: float
    """Predicted step time."""
    speedup_vs_bucket: float | None
    """``bucket-sp4`` (the DCP paper's baseline) time / predicted time, when it was computed."""
    speedup_vs_strongest: float | None = None
    """The strongest baseline's time (``planner.baselines.strongest``: the fastest but naive) /
    predicted time, when baselines were computed: the headline comparison."""
    solve_time_s: float
    """Wall time of the planner call (not stored in the plan)."""
    dropped_bounds: tuple[str, ...] = ()
    """Lower bounds the planner found above the plan's time and dropped (bugs; the service
    counts them)."""
    group_views: tuple[tuple[int, int, str], ...] = ()
    """Per group ``(first_rank, last_rank, view)``: the ``RankPlan`` JSON of its ranks without
    the ``rank`` field (see :func:`group_view_templates`); empty = derive when storing."""


def group_view_templates(plan_json: str, *, digest: str) -> list[tuple[int, int, str]]:
    """The rank views of a validated plan, one template per group.

    The view of rank ``r`` in a group is ``'{"rank":r,' + template[1:]``: exactly the fields of
    ``planner.plan.RankPlan`` as ``Plan.rank_view(r)`` fills them, with ``plan_digest`` the
    given digest (tests check the equivalence). Rendering once per step at write time lets the
    service answer a rank's fetch with one small indexed read and no parsing.
    """
    data: dict[str, Any] = json.loads(plan_json)
    groups = data["groups"]
    common = {"schema_version": data["schema_version"], "step": data["step"],
              "num_ranks": data["num_ranks"], "group_sizes": [len(g["ranks"]) for g in groups],
              "loss_normalizer": data["loss_normalizer"], "plan_digest": digest,
              "cost_model_id": data["cost_model_id"]}
    if any(g.get("ring_degree", 1) > 1 for g in groups):  # as Plan.rank_view: only with a ring
        common["ring_degrees"] = [g.get("ring_degree", 1) for g in groups]
    head = json.dumps(common, separators=(",", ":"))
    return [(g["ranks"][0], g["ranks"][-1],
             f'{head[:-1]},"group":{json.dumps(g, separators=(",", ":"))}}}') for g in groups]


def rank_view_json(template: str, rank: int) -> str:
    """The ``RankPlan`` JSON of ``rank`` from its group's template."""
    return f'{{"rank":{rank},{template[1:]}'


def canonical_step_plan(plan: Plan) -> Plan:
    """The plan with its wall-clock field zeroed, so equal inputs give equal bytes."""
    solver = plan.solver.model_copy(update={"wall_time_s": 0.0})
    return plan.model_copy(update={"solver": solver})


def epoch_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A stored epoch job's planner options: a job stored without a layout was made when
    ``ulysses`` was the default, and keeps planning as ``ulysses`` (its declared layouts are those)."""
    return {"layout": "ulysses", **spec["options"]}


def build_config(options: Mapping[str, Any], *, seed: int | None = None) -> Any:
    """A ``planner.config.PlannerConfig`` from request options.

    Raises:
        ValueError: naming an unknown option or an invalid value.
    """
    from dataclasses import fields as dc_fields

    from planner.config import PlannerConfig

    known = {f.name for f in dc_fields(PlannerConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown planner option(s) {unknown}; known: {sorted(known)}")
    values = dict(options)
    if seed is not None:
        values["seed"] = seed
    try:
        return PlannerConfig(**values)
    except TypeError as exc:
        raise ValueError(f"invalid planner options: {exc}") from None


def check_membership(plan: Plan, samples: Sequence[Sample], *, step: int | None) -> None:
    """Raise when the plan does not hold exactly the batch's samples (none dropped, none added).

    Raises:
        ValueError: naming the missing, extra or duplicated ids.
    """
    planned = plan.sample_ids
    expected = [s.id for s in samples]
    if sorted(planned) == sorted(expected):
        return
    missing = sorted(set(expected) - set(planned))[:5]
    extra = sorted(set(planned) - set(expected))[:5]
    dups = sorted({i for i in planned if planned.count(i) > 1})[:5]
    raise ValueError(f"plan of step {step} changed the batch: missing {missing}, extra {extra}, "
                     f"duplicated {dups}")


def plan_samples(samples: list[Sample], *, cluster: ClusterSpec, cost_model: CostModelFile,
                 options: Mapping[str, Any], step: int | None = None,
                 seed: int | None = None, with_group_views: bool = True) -> StepResult:
    """Plan one batch and check it (runs in a worker process). A lower bound found above the
    plan's step time is dropped, not raised (``PlannerConfig.strict_bounds``, unless ``options``
    set it), and named in the result's ``dropped_bounds``.

    Args:
        samples: The global batch.
        cluster: The world.
        cost_model: The cost model.
        options: PlannerConfig fields.
        step: Step index recorded in the plan.
        seed: Planner seed overriding ``options``.
        with_group_views: Render the rank-view templates (for storing).

    Raises:
        ValueError: from the planner (e.g. a sample that fits nowhere, named) or when the plan
            changed the batch.
    """
    from planner.planning import plan_batch_with_stats

    # A job or a request never fails on a wrong bound: it is dropped, logged and counted
    # (PlannerConfig.strict_bounds); the options can still ask for strict bounds.
    config = build_config({"strict_bounds": False, **options}, seed=seed)
    start = time.perf_counter()
    plan, stats = plan_batch_with_stats(samples, cluster=cluster, cost_model=cost_model, config=config, step=step)
    solve_time_s = time.perf_counter() - start
    check_membership(plan, samples, step=step)
    plan = canonical_step_plan(plan)
    text = plan.canonical_json()
    bucket = plan.baselines_s.get("bucket-sp4")
    speedup = bucket / plan.predicted_step_time_s if bucket and plan.predicted_step_time_s > 0 else None
    best = strongest(plan.baselines_s)
    vs_strongest = best[1] / plan.predicted_step_time_s if best and plan.predicted_step_time_s > 0 else None
    digest = hashlib.sha256(text.encode()).hexdigest()
    return StepResult(step=step, plan_json=text, digest=digest, gap=plan.gap,
                      predicted_step_time_s=plan.predicted_step_time_s, speedup_vs_bucket=speedup,
                      speedup_vs_strongest=vs_strongest,
                      solve_time_s=solve_time_s, dropped_bounds=stats.dropped_bounds,
                      group_views=tuple(group_view_templates(text, digest=digest))
                      if with_group_views else ())


def plan_step(task: StepTask) -> StepResult:
    """Plan one epoch step with its derived seed (runs in a worker process).

    Raises:
        ValueError: an empty or invalid batch, or any error of :func:`plan_samples`.
    """
    samples = [Sample.model_validate(s) for s in json.loads(task.samples_json)]
    if not samples:
        raise ValueError(f"step {task.step} has no samples")
    return plan_samples(samples, cluster=_cluster(task.cluster_json),
                        cost_model=_cost_model(task.cost_model_json), options=task.options,
                        step=task.step, seed=step_seed(task.seed, task.step))


class StepSink(Protocol):
    """Where finished steps go (the plan store)."""

    def write_steps(self, results: Sequence[StepResult]) -> int:
        """Store the results in one transaction; return how many were new."""
        ...


class CancelledError(Exception):
    """The job was cancelled; the steps written so far stay stored."""


def run_epoch(
    tasks: Iterable[StepTask],
    *,
    executor: Executor,
    sink: StepSink,
    max_in_flight: int,
    write_batch_steps: int = 16,
    should_stop: Callable[[], bool] = lambda: False,
    on_written: Callable[[int], None] = lambda n: None,
) -> int:
    """Plan every task on the executor and write the results to the sink.

    Tasks are submitted lazily, at most ``max_in_flight`` at a time; finished steps are written
    in transactions of at most ``write_batch_steps`` (or after ``FLUSH_INTERVAL_S``).

    Args:
        tasks: Steps still to plan (already-stored steps left out by the caller).
        executor: A process pool (or any executor) running :func:`plan_step`.
        sink: The store.
        max_in_flight: Steps submitted but not finished (use about twice the workers).
        write_batch_steps: Most steps per transaction.
        should_stop: Polled between results; when true, pending work is dropped and
            :class:`CancelledError` is raised after writing what finished.
        on_written: Called with the number of new steps after each write.

    Returns:
        Steps written.

    Raises:
        ValueError: the first step that failed (the job fails; finished steps stay stored).
        CancelledError: when ``should_stop`` turned true.
    """
    if max_in_flight <= 0:
        raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
    pending: set[Future[StepResult]] = set()
    buffer: list[StepResult] = []
    written = 0
    last_flush = time.monotonic()
    task_iter = iter(tasks)
    exhausted = False

    def flush() -> None:
        nonlocal written, last_flush, buffer
        if buffer:
            new = sink.write_steps(buffer)
            written += new
            on_written(new)
            buffer = []
        last_flush = time.monotonic()

    try:
        while True:
            while not exhausted and len(pending) < max_in_flight:
                task = next(task_iter, None)
                if task is None:
                    exhausted = True
                    break
                pending.add(executor.submit(plan_step, task))
            if not pending:
                break
            done, pending = wait(pending, timeout=FLUSH_INTERVAL_S, return_when=FIRST_COMPLETED)
            failure: BaseException | None = None
            for future in done:
                error = future.exception()
                if error is None:
                    buffer.append(future.result())
                elif failure is None:
                    failure = error
            if failure is not None:
                flush()
                raise failure
            if len(buffer) >= write_batch_steps or time.monotonic() - last_flush >= FLUSH_INTERVAL_S:
                flush()
            if should_stop():
                flush()
                raise CancelledError()
        flush()
    except BaseException:
        for future in pending:
            future.cancel()
        raise
    return written
