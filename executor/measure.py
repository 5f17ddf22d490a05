"""Measured step times and peak memory of one rank, posted to the planner service in the background.

:class:`StepTimer` times every micro-batch this rank runs (the time between the executor
handing it out and the training loop asking for the next one: the loop's forward and
backward) and the peak memory of each step:

* CPU: ``time.perf_counter`` around each micro-batch; no allocator peak exists, so
  ``peak_bytes`` is None;
* CUDA: an event recorded on the current stream before and after each micro-batch, and
  ``torch.cuda.max_memory_allocated`` (a host-side counter) per step. Nothing synchronises: a
  step's events are read at a later :meth:`StepTimer.begin_step`, once ``Event.query()`` says
  they completed (a step still running on the device waits for the next one).

Finished steps go to a sink, normally :class:`MeasurementReporter`, which posts them to
``POST /v1/epochs/{epoch_id}/measurements`` from a thread, several steps per request. A post
that fails is retried (the client's backoff, up to ``post_deadline_s``, then up to
``max_attempts`` batches); a batch that still fails, or that the service rejects (a 4xx, e.g.
a digest of another plan), is dropped with a warning. Training never waits for the service.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.client import PlannerClient, PlanRequestError, PlanUnavailableError
from planner.plan import RankPlan

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True, slots=True)
class StepMeasurement:
    """What one rank measured in one step."""

    step: int
    """Step index in the epoch."""
    rank: int
    """The rank that measured."""
    plan_digest: str
    """Digest of the plan that ran."""
    micro_batch_times_s: tuple[float, ...]
    """Forward+backward seconds of each of the rank's micro-batches, in plan order."""
    peak_bytes: int | None
    """Peak allocated bytes of the step (CUDA), None where the device has no allocator peak."""

    def as_json(self) -> dict[str, Any]:
        """The wire form of one step (``api.routers.measurements.StepMeasurementIn``)."""
        return {"step": self.step, "rank": self.rank, "plan_digest": self.plan_digest,
                "micro_batch_times_s": list(self.micro_batch_times_s), "peak_bytes": self.peak_bytes}


@dataclass(slots=True)
class _OpenStep:
    step: int
    digest: str
    num_micro_batches: int
    times_s: list[float] = field(default_factory=list)
    events: list[tuple[Any, Any]] = field(default_factory=list)
    peak_bytes: int | None = None


class StepTimer:
    """Times one rank's micro-batches per step; hands finished steps to ``sink``.

    The executor calls :meth:`begin_step`, :meth:`start` and :meth:`stop`; call :meth:`flush`
    after the last step.
    """

    def __init__(self, *, rank: int, sink: Callable[[StepMeasurement], None],
                 device: torch.device | str = "cpu") -> None:
        """Bind the timer.

        Args:
            rank: This rank.
            sink: Receives each finished step (must not block: e.g. ``MeasurementReporter.submit``).
            device: ``cuda`` (events, allocator peak) or ``cpu`` (``perf_counter``).
        """
        self.rank = rank
        self.sink = sink
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._open: _OpenStep | None = None
        self._unresolved: list[_OpenStep] = []
        self._start: Any = None

    def begin_step(self, rank_plan: RankPlan, *, step: int) -> None:
        """Close the previous step (peak read now, times when its events completed); open ``step``."""
        self._close_open()
        self._resolve(block=False)
        self._open = _OpenStep(step=step, digest=rank_plan.plan_digest,
                               num_micro_batches=len(rank_plan.group.micro_batches))

    def start(self) -> None:
        """A micro-batch is handed to the training loop."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._start = event
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        """The training loop asked for the next micro-batch (the previous one's backward is issued)."""
        if self._open is None or self._start is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._open.events.append((self._start, end))
        else:
            self._open.times_s.append(time.perf_counter() - self._start)
        self._start = None

    def flush(self) -> None:
        """Close the open step and hand over every step (waits for the device's events)."""
        self._close_open()
        self._resolve(block=True)

    def _close_open(self) -> None:
        step = self._open
        if step is None:
            return
        self._open = None
        if self.cuda:
            step.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        self._unresolved.append(step)

    def _resolve(self, *, block: bool) -> None:
        while self._unresolved:
            step = self._unresolved[0]
            if step.events:
                last = step.events[-1][1]
                if not block and not last.query():
                    return  # still running on the device: try at the next step
                last.synchronize()
                step.times_s = [start.elapsed_time(end) / 1e3 for start, end in step.events]
            self._unresolved.pop(0)
            if len(step.times_s) != step.num_micro_batches:
                logger.warning("rank %d: step %d ran %d of its %d micro-batches; not reported",
                               self.rank, step.step, len(step.times_s), step.num_micro_batches)
                continue
            self.sink(StepMeasurement(step=step.step, rank=self.rank, plan_digest=step.digest,
                                      micro_batch_times_s=tuple(step.times_s),
                                      peak_bytes=step.peak_bytes))


@dataclass(kw_only=True, frozen=True, slots=True)
class ReporterConfig:
    """How measurements are batched and posted."""

    batch_steps: int = 8
    """Steps per request (a partial batch is posted after ``flush_interval_s``)."""
    flush_interval_s: float = 2.0
    """Longest time a measurement waits before it is posted."""
    post_deadline_s: float = 5.0
    """Deadline of one post, the client's retries included."""
    max_attempts: int = 3
    """Posts of one batch before it is dropped with a warning."""
    max_queued_steps: int = 4096
    """Steps held while the service is unreachable; the oldest are dropped past this."""

    def __post_init__(self) -> None:
        for name in ("batch_steps", "max_attempts", "max_queued_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("flush_interval_s", "post_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class MeasurementReporter:
    """Posts one rank's step measurements from a background thread, in batches."""

    def __init__(self, client: PlannerClient, *, epoch_id: str, rank: int,
                 config: ReporterConfig | None = None) -> None:
        """Start the posting thread.

        Args:
            client: The service client (thread-safe).
            epoch_id: The epoch the steps belong to.
            rank: This rank (for log lines).
            config: Batching and retry settings.
        """
        self.client, self.epoch_id, self.rank = client, epoch_id, rank
        self.config = config or ReporterConfig()
        self._queue: queue.Queue[StepMeasurement | None] = queue.Queue()
        self.num_posted_steps = 0
        """Steps the service accepted."""
        self.num_dropped_steps = 0
        """Steps given up on (rejected, unreachable, or queue overflow)."""
        self._thread = threading.Thread(target=self._loop, name=f"dcp-measure-r{rank}", daemon=True)
        self._thread.start()

    def submit(self, measurement: StepMeasurement) -> None:
        """Queue one step (never blocks; the oldest step is dropped when the queue is full)."""
        if self._queue.qsize() >= self.config.max_queued_steps:
            try:
                self._queue.get_nowait()
                self.num_dropped_steps += 1
            except queue.Empty:
                pass
        self._queue.put_nowait(measurement)

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Post what is queued and stop the thread (waits at most ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        batch: list[StepMeasurement] = []
        first_at = 0.0
        closing = False
        interval = self.config.flush_interval_s
        while not closing:
            timeout = interval if not batch else max(first_at + interval - time.monotonic(), 1e-3)
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            else:
                if item is None:
                    closing = True
                else:
                    if not batch:
                        first_at = time.monotonic()
                    batch.append(item)
            if batch and (closing or len(batch) >= self.config.batch_steps
                          or time.monotonic() >= first_at + interval):
                self._post(batch)
                batch = []

    def _post(self, batch: list[StepMeasurement]) -> None:
        path = f"/v1/epochs/{self.epoch_id}/measurements"
        body = {"steps": [m.as_json() for m in batch]}
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                self.client.request("POST", path, json=body, deadline_s=self.config.post_deadline_s)
            except PlanRequestError as exc:
                logger.warning("rank %d: the service rejected measurements of steps %s; dropped: %s",
                               self.rank, [m.step for m in batch], exc)
                break
            except PlanUnavailableError as exc:
                if attempt == self.config.max_attempts:
                    logger.warning("rank %d: measurements of steps %s not posted after %d attempts; "
                                   "dropped: %s", self.rank, [m.step for m in batch], attempt, exc)
                    break
                continue
            except Exception as exc:  # never let the reporter thread die (closed client, ...)
                logger.warning("rank %d: posting measurements failed; dropped: %s", self.rank, exc)
                break
            else:
                self.num_posted_steps += len(batch)
                return
        self.num_dropped_steps += len(batch)
