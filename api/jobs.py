"""Epoch jobs: creation (steps fixed up front), running over the process pool, resuming.

``prepare_epoch`` and ``run_epoch_job`` are shared by the service and ``dcp epoch``; the
``JobManager`` runs jobs on threads of the service, each driving the shared process pool.

Failures are told apart by cause (``api.faults.classify``): a job that hits a passing fault
(a killed solver worker, a full disk, a store locked by another process) goes back to
``queued`` with the cause in ``error`` and is retried by the service with exponential backoff
(its stored steps kept, only the missing ones re-planned); after ``max_transient_retries``
retries it is ``failed`` with ``transient`` set, and it is retried again at the next start or
by ``POST /v1/epochs/{id}/resume``. Any other failure (a sample that fits nowhere, a step past
its deadline) fails the job at once.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from api.faults import classify
from api.metrics import Metrics
from api.registry import check_compatible
from api.store import ACTIVE_STATES, EpochRecord, PlanStore
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.epoch import BatchRule, CancelledError, StepResult, StepTask, build_config, make_steps, run_epoch

logger = logging.getLogger(__name__)

T = TypeVar("T")


def manifest_digest(samples: Sequence[Sample]) -> str:
    """SHA-256 over the manifest's samples (ids and shapes, in order)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.model_dump_json(exclude_none=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def prepare_epoch(store: PlanStore, *, epoch_id: str, samples: Sequence[Sample], rule: BatchRule,
                  seed: int, cluster: ClusterSpec, cost_model: CostModelFile,
                  options: Mapping[str, Any], manifest_source: str) -> EpochRecord:
    """Validate a job, cut the manifest into steps and store it as queued.

    Raises:
        ValueError: invalid options, a cost model for other hardware, a sample longer than
            the token budget, an empty manifest.
        api.store.EpochExistsError: when the id is taken.
    """
    build_config(options)
    check_compatible(cost_model, cluster)
    steps = make_steps(samples, rule=rule, seed=seed)
    spec = {
        "batch": rule.as_dict(), "seed": seed, "cluster": cluster.model_dump(mode="json"),
        "cost_model_id": cost_model.id, "cost_model_digest": cost_model.digest(),
        "options": dict(options),
        "manifest": {"source": manifest_source, "num_samples": len(samples),
                     "digest": manifest_digest(samples)},
    }
    return store.create_epoch(epoch_id, spec=spec, steps=steps)


def same_request(record: EpochRecord, *, rule: BatchRule, seed: int, cluster: ClusterSpec,
                 cost_model: CostModelFile, options: Mapping[str, Any],
                 samples: Sequence[Sample]) -> bool:
    """True when a stored job was made from exactly these inputs (so it may be resumed)."""
    spec = record.spec
    return (spec["batch"] == rule.as_dict() and spec["seed"] == seed
            and spec["cluster"] == cluster.model_dump(mode="json")
            and spec["cost_model_digest"] == cost_model.digest() and spec["options"] == dict(options)
            and spec["manifest"]["digest"] == manifest_digest(samples))


def _tasks(store: PlanStore, record: EpochRecord, cluster: ClusterSpec,
           cost_model: CostModelFile) -> Iterator[StepTask]:
    cluster_json, cost_model_json = cluster.model_dump_json(), cost_model.model_dump_json()
    for step in store.pending_steps(record.id):
        yield StepTask(step=step, samples_json=store.batch_json(record.id, step),
                       cluster_json=cluster_json, cost_model_json=cost_model_json,
                       options=record.spec["options"], seed=record.spec["seed"])


class _MeteredSink:
    def __init__(self, store: PlanStore, epoch_id: str, metrics: Metrics | None) -> None:
        self.store = store
        self.epoch_id = epoch_id
        self.metrics = metrics

    def write_steps(self, results: Sequence[StepResult]) -> int:
        new = self.store.write_steps(self.epoch_id, results)
        if self.metrics is not None:
            for r in results:
                self.metrics.solver_latency_s.labels("epoch").observe(r.solve_time_s)
        return new


def planner_wall_cap_s(options: Mapping[str, Any], *, num_gpus: int, num_samples: int | None = None) -> float:
    """The wall time the planner itself allows a plan with these options (before the margin).

    That is ``time_limit_s``, or ``exact_time_limit_s`` when larger and the exact CP-SAT model
    may run (CP-SAT on, at most ``exact_max_samples`` samples — any step size when None — and
    at most ``exact_max_ranks`` GPUs): ``planner.planning`` gives the exact model that budget.

    Raises:
        ValueError: for invalid options.
    """
    config = build_config(options)
    exact = (config.use_cpsat and num_gpus <= config.exact_max_ranks
             and (num_samples is None or num_samples <= config.exact_max_samples))
    return max(config.time_limit_s, config.exact_time_limit_s) if exact else config.time_limit_s


class _DeadlineExecutor(Executor):
    """Submits every task under one wall-clock deadline (to a ``SolverPool`` or a
    ``api.ray_runner.RayStepExecutor``: any executor with ``submit_with_deadline``)."""

    def __init__(self, pool: Any, deadline_s: float) -> None:
        self.pool = pool
        self.deadline_s = deadline_s

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self.pool.submit_with_deadline(self.deadline_s, fn, *args, **kwargs)


def _record_state(store: PlanStore, epoch_id: str, state: str, **kwargs: Any) -> None:
    """Record a final state; a store that cannot be written (full, locked) is logged, not raised:
    the job stays ``running`` in the file and is resumed at the next start."""
    try:
        store.set_state(epoch_id, state, **kwargs)
    except Exception as exc:
        logger.warning("epoch %s: could not record state %s: %s", epoch_id, state, classify(exc).message)


def run_epoch_job(store: PlanStore, epoch_id: str, *, get_cost_model: Callable[[str], CostModelFile],
                  executor: Executor, num_workers: int, write_batch_steps: int = 16,
                  should_stop: Callable[[], bool] = lambda: False,
                  stop_state: Callable[[], str] = lambda: "cancelled",
                  on_written: Callable[[int], None] = lambda n: None,
                  metrics: Metrics | None = None, max_steps: int | None = None,
                  deadline_margin_s: float | None = None, requeue_transient: bool = False) -> EpochRecord:
    """Plan every step of a stored job that has no plan yet; record the final state.

    Args:
        store: The plan store.
        epoch_id: The job.
        get_cost_model: Resolves the job's cost-model id.
        executor: The process pool (or a ``RayStepExecutor``).
        num_workers: Its size (about twice as many steps are kept in flight; for Ray, its
            ``num_slots()``).
        write_batch_steps: Most steps per transaction.
        should_stop: Polled; true stops the job after writing what finished.
        stop_state: The state a stopped job gets (``cancelled``, or ``queued`` at shutdown).
        on_written: Called with the number of new steps after each write.
        metrics: Service metrics, if any.
        max_steps: Plan at most this many of the pending steps (the job stays queued).
        deadline_margin_s: With a ``SolverPool`` or Ray: each step is stopped at the planner's own
            wall cap (``planner_wall_cap_s``) plus this margin (None: no deadline).
        requeue_transient: A transient failure leaves the job ``queued`` (to be retried) instead
            of ``failed``; either way ``transient`` is recorded.

    Returns:
        The job as stored at the end (done, failed, cancelled or queued).
    """
    record = store.get_epoch(epoch_id)
    if record is None:
        raise KeyError(f"unknown epoch {epoch_id!r}")
    try:
        store.set_state(epoch_id, "running")
        cost_model = get_cost_model(record.spec["cost_model_id"])
        if cost_model.digest() != record.spec["cost_model_digest"]:
            raise ValueError(f"cost model {cost_model.id!r} changed since the job was created")
        cluster = ClusterSpec.model_validate(record.spec["cluster"])
        if hasattr(executor, "num_slots"):  # a Ray cluster: its size now (it may have grown)
            num_workers = executor.num_slots()
        tasks = _tasks(store, record, cluster, cost_model)
        if max_steps is not None:
            tasks = itertools.islice(tasks, max_steps)
        if deadline_margin_s is not None and hasattr(executor, "submit_with_deadline"):
            limit_s = planner_wall_cap_s(record.spec["options"], num_gpus=cluster.num_gpus)
            executor = _DeadlineExecutor(executor, limit_s + deadline_margin_s)
        run_epoch(tasks, executor=executor,
                  sink=_MeteredSink(store, epoch_id, metrics), max_in_flight=2 * num_workers,
                  write_batch_steps=write_batch_steps, should_stop=should_stop,
                  on_written=on_written)
    except CancelledError:
        _record_state(store, epoch_id, stop_state())
    except Exception as exc:
        fault = classify(exc)
        message = fault.message if fault.transient else f"{type(exc).__name__}: {exc}"
        logger.warning("epoch %s %s: %s", epoch_id, "interrupted" if fault.transient else "failed", message)
        state = "queued" if fault.transient and requeue_transient else "failed"
        _record_state(store, epoch_id, state, error=message, transient=fault.transient)
    else:
        done = store.get_epoch(epoch_id)
        complete = done is not None and done.steps_done >= done.steps_total
        _record_state(store, epoch_id, "done" if complete else "queued")
    final = store.get_epoch(epoch_id)
    assert final is not None
    return final


@dataclass(slots=True)
class _Run:
    thread: threading.Thread
    cancel: threading.Event
    started_monotonic: float
    steps_at_start: int
    steps_done: int
    wake: threading.Event = field(default_factory=threading.Event)
    """Set by ``resume`` to end a backoff wait early."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RetryPolicy:
    """How the service retries jobs after transient failures."""

    first_backoff_s: float = 1.0
    """Wait before the first retry; doubled after each further failure."""
    max_backoff_s: float = 60.0
    """Longest wait between retries."""
    max_transient_retries: int = 20
    """Retries before the job is left ``failed`` (until the next start or a resume)."""
    deadline_margin_s: float | None = 1.0
    """Each step stops at the job's ``time_limit_s`` plus this (None: no deadline)."""

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry number ``attempt`` (1-based)."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(attempt - 1, 0))


class JobManager:
    """Runs epoch jobs on threads of the service; each thread drives the shared process pool."""

    def __init__(self, store: PlanStore, *, get_cost_model: Callable[[str], CostModelFile],
                 executor: Executor, num_workers: int, write_batch_steps: int,
                 metrics: Metrics | None = None, retry: RetryPolicy | None = None) -> None:
        self.store = store
        self.get_cost_model = get_cost_model
        self.executor = executor
        self.num_workers = num_workers
        self.write_batch_steps = write_batch_steps
        self.metrics = metrics
        self.retry = retry or RetryPolicy()
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._shutdown = threading.Event()

    def start(self, epoch_id: str) -> None:
        """Start (or resume) a stored job on a new thread (wake it if it waits to retry)."""
        record = self.store.get_epoch(epoch_id)
        if record is None:
            raise KeyError(f"unknown epoch {epoch_id!r}")
        with self._lock:
            if epoch_id in self._runs and self._runs[epoch_id].thread.is_alive():
                self._runs[epoch_id].wake.set()
                return
            cancel = threading.Event()
            thread = threading.Thread(target=self._run, args=(epoch_id, cancel),
                                      name=f"epoch-{epoch_id}", daemon=True)
            self._runs[epoch_id] = _Run(thread=thread, cancel=cancel,
                                        started_monotonic=time.monotonic(),
                                        steps_at_start=record.steps_done,
                                        steps_done=record.steps_done)
            thread.start()

    def resume(self, epoch_id: str) -> EpochRecord:
        """Resume a failed or cancelled job (or wake one waiting to retry); a done job is left.

        Raises:
            KeyError: for an unknown epoch.
        """
        record = self.store.get_epoch(epoch_id)
        if record is None:
            raise KeyError(f"unknown epoch {epoch_id!r}")
        if record.state in ("failed", "cancelled"):
            self.store.reset_attempts(epoch_id)
            self.store.set_state(epoch_id, "queued")
        if record.state != "done":
            self.start(epoch_id)
        final = self.store.get_epoch(epoch_id)
        assert final is not None
        return final

    def _run(self, epoch_id: str, cancel: threading.Event) -> None:
        run = self._runs[epoch_id]

        def on_written(new: int) -> None:
            run.steps_done += new
            if self.metrics is not None:
                record = self.store.get_epoch(epoch_id)
                if record is not None:
                    self.metrics.job_steps_done.labels(epoch_id).set(record.steps_done)
                    self.metrics.job_progress.labels(epoch_id).set(
                        record.steps_done / max(record.steps_total, 1))

        def stopping() -> bool:
            return cancel.is_set() or self._shutdown.is_set()

        attempt = 0
        while True:
            try:
                final = run_epoch_job(
                    self.store, epoch_id, get_cost_model=self.get_cost_model, executor=self.executor,
                    num_workers=self.num_workers, write_batch_steps=self.write_batch_steps,
                    should_stop=stopping,
                    stop_state=lambda: "queued" if self._shutdown.is_set() and not cancel.is_set()
                    else "cancelled",
                    on_written=on_written, metrics=self.metrics,
                    deadline_margin_s=self.retry.deadline_margin_s, requeue_transient=True)
                cause = final.error or "its end state could not be recorded"
                # Queued after a passing fault, or still active in the store because recording the
                # outcome failed too (a locked or full store): run again; a finished job returns
                # at once with its state recorded.
                retry = final.state in ("queued", "running") and (final.transient or final.state == "running")
            except Exception as exc:  # the store itself failed (set_state, get_epoch)
                fault = classify(exc)
                if not fault.transient:
                    logger.exception("epoch %s crashed", epoch_id)
                    return
                cause, retry = fault.message, True
            if not retry or stopping():
                if retry and cancel.is_set():
                    _record_state(self.store, epoch_id, "cancelled")
                break
            attempt += 1
            if attempt > self.retry.max_transient_retries:
                logger.warning("epoch %s: giving up after %d retries: %s", epoch_id, attempt - 1, cause)
                _record_state(self.store, epoch_id, "failed", error=f"{cause} (gave up after "
                              f"{attempt - 1} retries; POST /v1/epochs/{epoch_id}/resume)", transient=True)
                return
            wait_s = self.retry.backoff_s(attempt)
            logger.warning("epoch %s: transient failure (%s); retry %d in %.1f s", epoch_id, cause,
                           attempt, wait_s)
            run.wake.clear()
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not stopping() and not run.wake.is_set():
                run.wake.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            if cancel.is_set():
                _record_state(self.store, epoch_id, "cancelled")
                return
            if self._shutdown.is_set():
                return
        try:
            final = self.store.get_epoch(epoch_id) or final
            logger.info("epoch %s ended %s (%d/%d steps)", epoch_id, final.state, final.steps_done,
                        final.steps_total)
        except Exception as exc:
            logger.warning("epoch %s ended; state unreadable: %s", epoch_id, classify(exc).message)

    def cancel(self, epoch_id: str) -> EpochRecord:
        """Cancel a queued or running job (a finished job is left as it is).

        Raises:
            KeyError: for an unknown epoch.
        """
        record = self.store.get_epoch(epoch_id)
        if record is None:
            raise KeyError(f"unknown epoch {epoch_id!r}")
        with self._lock:
            run = self._runs.get(epoch_id)
        if run is not None and run.thread.is_alive():
            run.cancel.set()
            run.thread.join(timeout=30.0)
        elif record.state in ACTIVE_STATES:
            self.store.set_state(epoch_id, "cancelled")
        final = self.store.get_epoch(epoch_id)
        assert final is not None
        return final

    def eta_s(self, record: EpochRecord) -> float | None:
        """Seconds to finish at the current run's rate (0 when done, None when unknown)."""
        if record.state == "done":
            return 0.0
        run = self._runs.get(record.id)
        if record.state != "running" or run is None:
            return None
        planned = run.steps_done - run.steps_at_start
        elapsed = time.monotonic() - run.started_monotonic
        if planned <= 0 or elapsed <= 0:
            return None
        return (record.steps_total - record.steps_done) * elapsed / planned

    def steps_per_s(self, record: EpochRecord) -> float | None:
        """Steps stored per second by the current run (None when not running or none yet)."""
        run = self._runs.get(record.id)
        if record.state != "running" or run is None:
            return None
        planned = run.steps_done - run.steps_at_start
        elapsed = time.monotonic() - run.started_monotonic
        return planned / elapsed if planned > 0 and elapsed > 0 else None

    def resume_all(self) -> list[str]:
        """Start every job stored as queued or running (after a restart or a crash), and every
        job that failed for a transient reason."""
        resumed = [r.id for r in self.store.list_epochs()
                   if r.state in ACTIVE_STATES or (r.state == "failed" and r.transient)]
        for epoch_id in resumed:
            record = self.store.get_epoch(epoch_id)
            if record is not None and record.state == "failed":
                self.store.reset_attempts(epoch_id)
                self.store.set_state(epoch_id, "queued")
            logger.info("resuming epoch %s", epoch_id)
            self.start(epoch_id)
        return resumed

    def shutdown(self, *, timeout_s: float = 30.0) -> None:
        """Stop every job after its finished steps are written; they resume at next start."""
        self._shutdown.set()
        with self._lock:
            runs = list(self._runs.values())
        deadline = time.monotonic() + timeout_s
        for run in runs:
            run.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def active(self) -> list[str]:
        """Ids of the jobs whose thread is running."""
        with self._lock:
            return [k for k, r in self._runs.items() if r.thread.is_alive()]
