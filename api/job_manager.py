"""The service's epoch jobs on threads (``JobManager``), each driving the shared process pool.

Failures are told apart by cause (``api.faults.classify``): a job that hits a passing fault
(a killed solver worker, a full disk, a store locked by another process) goes back to
``queued`` with the cause in ``error`` and is retried with exponential backoff (its stored
steps kept, only the missing ones re-planned); after ``max_transient_retries`` retries in a row
without a step stored between them it is
``failed`` with ``transient`` set, and it is retried again at the next start or by
``POST /v1/epochs/{id}/resume``. Any other failure (a sample that fits nowhere, a step past
its deadline) fails the job at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

from api.faults import classify
from api.jobs import planner_wall_cap_s, record_state, run_epoch_job
from api.metrics import Metrics
from api.store import ACTIVE_STATES, EpochRecord, PlanStore
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec

logger = logging.getLogger(__name__)

SHUTDOWN_ERROR = "the service shut down while the job ran; it resumes at the service's next start"
"""A job's ``error`` (state ``queued``) after a shutdown stopped it."""


@dataclass(slots=True)
class _Run:
    thread: threading.Thread
    cancel: threading.Event
    started_monotonic: float
    steps_at_start: int
    steps_done: int
    wake: threading.Event = field(default_factory=threading.Event)
    """Set by ``resume`` to end a backoff wait early."""
    fault: str | None = None
    """The passing fault the job waits out (cleared by the next stored step): known here even
    when the store cannot record it."""
    retry_at: float | None = None
    """``time.monotonic()`` of the next retry while ``fault`` is set."""
    attempts: int = 0
    """Transient failures of this run."""
    progress_at: float = 0.0
    """``time.monotonic()`` of the last step stored (or of the attempt's start)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LiveFault:
    """A running job's passing fault, as the service knows it (the store may not say it: a store
    that cannot be written keeps the job ``running`` with no error)."""

    cause: str
    """The fault in plain words."""
    attempts: int
    """Transient failures of this run so far."""
    retry_in_s: float
    """Seconds until the next retry (0: retrying now)."""


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
    stall_floor_s: float = 120.0
    """The shortest time a running job may store no step before it is stopped and retried as a
    transient failure (``JobManager._stall_s``)."""

    def margin_s(self, attempt: int) -> float | None:
        """The deadline margin of retry ``attempt`` (0: the first run): doubled after each transient
        failure without progress, with no cap, so a host too loaded for a step's deadline gets
        more room, not the same failure; ``max_transient_retries`` bounds the doubling (the job
        then fails, naming the cause and the retries)."""
        return None if self.deadline_margin_s is None else self.deadline_margin_s * 2.0 ** attempt

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

    def _record(self, epoch_id: str) -> EpochRecord:
        """The stored job; KeyError for an unknown epoch."""
        record = self.store.get_epoch(epoch_id)
        if record is None:
            raise KeyError(f"unknown epoch {epoch_id!r}")
        return record

    def start(self, epoch_id: str) -> None:
        """Start (or resume) a stored job on a new thread (wake it if it waits to retry)."""
        record = self._record(epoch_id)
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
        record = self._record(epoch_id)
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
            run.progress_at = time.monotonic()
            run.fault = None  # the store takes writes again
            if self.metrics is not None:
                record = self.store.get_epoch(epoch_id)
                if record is not None:
                    self.metrics.job_steps_done.labels(epoch_id).set(record.steps_done)
                    self.metrics.job_progress.labels(epoch_id).set(
                        record.steps_done / max(record.steps_total, 1))

        def stopping() -> bool:
            return cancel.is_set() or self._shutdown.is_set()

        stall: list[str] = []  # why the current attempt was stopped for want of progress

        def stopping_or_stalled() -> bool:
            if stopping():
                return True
            quiet_s = time.monotonic() - run.progress_at
            if quiet_s > stall_s and not stall:
                stall.append(f"no step stored for {quiet_s:.0f} s (over {stall_s:.0f} s: the steps' "
                             f"deadline x {self.retry.max_transient_retries} retries); restarted")
            return bool(stall)

        def stop_state() -> str:
            return "queued" if stall or (self._shutdown.is_set() and not cancel.is_set()) else "cancelled"

        def stop_error() -> str | None:
            if cancel.is_set():
                return None
            return SHUTDOWN_ERROR if self._shutdown.is_set() else (stall[0] if stall else None)

        attempt = 0  # transient failures in a row without a step stored between them
        steps_at_failure = run.steps_done
        while True:
            stall.clear()
            stall_s = self._stall_s(epoch_id, attempt)
            run.progress_at = time.monotonic()
            try:
                final = run_epoch_job(
                    self.store, epoch_id, get_cost_model=self.get_cost_model, executor=self.executor,
                    num_workers=self.num_workers, write_batch_steps=self.write_batch_steps,
                    should_stop=stopping_or_stalled, stop_state=stop_state, stop_error=stop_error,
                    on_written=on_written, metrics=self.metrics,
                    deadline_margin_s=self.retry.margin_s(attempt), requeue_transient=True)
                cause = final.error or "its end state could not be recorded"
                # Queued after a passing fault or a stall, or still active in the store because
                # recording the outcome failed too (a locked or full store): run again; a finished
                # job returns at once with its state recorded.
                retry = final.state in ("queued", "running") and (
                    final.transient or final.state == "running" or bool(stall))
                if stall:
                    logger.warning("epoch %s: %s", epoch_id, stall[0])
            except Exception as exc:  # the store itself failed (set_state, get_epoch)
                fault = classify(exc)
                if not fault.transient:
                    logger.exception("epoch %s crashed", epoch_id)
                    return
                cause, retry = fault.message, True
            if not retry or stopping():
                if retry and cancel.is_set():
                    record_state(self.store, epoch_id, "cancelled")
                break
            if run.steps_done > steps_at_failure:  # progress since the last failure: a new count
                attempt = 0
            steps_at_failure = run.steps_done
            attempt += 1
            if attempt > self.retry.max_transient_retries:
                logger.warning("epoch %s: giving up after %d retries: %s", epoch_id, attempt - 1, cause)
                record_state(self.store, epoch_id, "failed", error=f"{cause} (gave up after "
                              f"{attempt - 1} retries; POST /v1/epochs/{epoch_id}/resume)", transient=True)
                return
            wait_s = self.retry.backoff_s(attempt)
            run.fault, run.attempts, run.retry_at = cause, attempt, time.monotonic() + wait_s
            logger.warning("epoch %s: transient failure (%s); retry %d in %.1f s", epoch_id, cause,
                           attempt, wait_s)
            run.wake.clear()
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not stopping() and not run.wake.is_set():
                run.wake.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            if cancel.is_set():
                record_state(self.store, epoch_id, "cancelled")
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
        record = self._record(epoch_id)
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

    def live_fault(self, epoch_id: str) -> LiveFault | None:
        """The passing fault a job's live run waits out or retries (None when it has none)."""
        with self._lock:
            run = self._runs.get(epoch_id)
        if run is None or not run.thread.is_alive() or run.fault is None:
            return None
        retry_in_s = max(0.0, (run.retry_at or 0.0) - time.monotonic())
        return LiveFault(cause=run.fault, attempts=run.attempts, retry_in_s=retry_in_s)

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
        """Steps stored per second by the job's latest run in this server: so far while it runs,
        over the whole run once it ended (done, failed, cancelled). None when it has not run here
        (a job of an earlier server, or planned offline) or stored no step yet."""
        run = self._runs.get(record.id)
        if run is None:
            return None
        planned = run.steps_done - run.steps_at_start
        if record.state == "running":
            elapsed = time.monotonic() - run.started_monotonic
        elif record.finished_at is not None and record.started_at is not None and not run.thread.is_alive():
            elapsed = record.finished_at - record.started_at
        else:
            return None
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

    def _stall_s(self, epoch_id: str, attempt: int) -> float:
        """How long attempt ``attempt`` of a job may store no step before it is stopped and
        retried: its steps' deadline times ``max_transient_retries``, at least
        ``stall_floor_s`` (a pool cannot hold a step longer: it kills a worker past a step's
        deadline and replaces dead ones, so this catches what nothing else does)."""
        margin_s = self.retry.margin_s(attempt)
        record = self.store.get_epoch(epoch_id)
        if margin_s is None or record is None:
            return self.retry.stall_floor_s
        try:
            num_gpus = ClusterSpec.model_validate(record.spec["cluster"]).num_gpus
            deadline_s = planner_wall_cap_s(record.spec["options"], num_gpus=num_gpus) + margin_s
        except (KeyError, ValueError):
            return self.retry.stall_floor_s
        return max(self.retry.stall_floor_s, deadline_s * max(self.retry.max_transient_retries, 1))

    def request_shutdown(self) -> None:
        """Tell every job to stop (they stop at their next look, or when their steps fail)."""
        self._shutdown.set()

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
