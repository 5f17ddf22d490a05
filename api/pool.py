"""The solver process pool: no read of a worker's result can block, dead workers are replaced.

``SolverPool`` is an ``Executor`` over spawned worker processes (``api.pool_worker``), each with
its own socket pair to the service and nothing shared between workers. One dispatcher thread
owns every worker: it waits (``poll``) on their sockets and their process sentinels, reads
results without ever blocking (``api.pool_channel``: a partial frame stays in a buffer), hands
queued tasks to idle workers, and starts a new worker for each one that exits.

Why not ``concurrent.futures.ProcessPoolExecutor`` (Python 3.11): its workers share one result
pipe under one lock, and its manager thread, once the pipe is readable, reads a whole message
with a blocking ``recv``. A worker killed halfway through writing an ~80 KB result (the kernel's
out-of-memory killer, or ``kill -9``) left that ``recv`` waiting for bytes that never come (the
pipe's write end stays open in the other processes): every later result, the detection of dead
workers, their replacement and the service's shutdown waited with it, for good. A worker killed
while holding the pipe's lock blocked every other worker's result. ``multiprocessing.Pool`` has
the same shared queues and does not even notice a worker lost mid-task.

What the pool guarantees:

* A worker that exits (killed, out of memory, its imports broken) is seen at once by its
  sentinel, reaped and replaced. Its task is run again once on another worker (``max_reruns``)
  and then fails with :class:`WorkerDiedError`, whose message names the worker and how it died.
* A result frame that stops halfway for ``result_timeout_s`` gets its worker killed (and the
  task failed, naming why).
* Deadlines (``submit_with_deadline``) count from when a worker is handed the task: the worker
  stops the task itself at the deadline (``api.pool_worker.run_with_deadline``); one still
  running ``grace_s`` later (native code that never returns to Python) has its worker killed and
  fails with :class:`WorkerDiedError` naming the deadline.
* :meth:`SolverPool.health` says what readiness needs: workers ready of those configured, tasks
  past their deadline, a dispatcher that stopped running.
* ``shutdown(kill_running=True)`` kills the workers and fails what they ran; it returns within
  a bound whatever the workers do.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, ParamSpec, TypeVar

from api.faults import PoolShutDownError
from api.pool_channel import Channel
from api.pool_worker import (
    PARENT_POLL_S,
    READY,
    TERM_GRACE_S,
    WORKER_MODULES,
    DeadlineExceededError,
    preload,
    run_with_deadline,
    worker_main,
)

__all__ = ["PARENT_POLL_S", "TERM_GRACE_S", "WORKER_MODULES", "DeadlineExceededError", "PoolHealth",
           "SolverPool", "WorkerDiedError", "make_executor", "preload", "run_with_deadline"]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

POLL_S = 0.1
"""Longest sleep of the dispatcher between two looks at its timers."""

STALL_S = 5.0
"""A dispatcher that has not run for this long makes the pool unhealthy."""

EXIT_WAIT_S = 3.0
"""At shutdown, how long idle workers get to leave after their socket is closed before they
are killed."""


class WorkerDiedError(BrokenProcessPool):
    """The worker running the task exited (or was killed by the pool); the message says how."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PoolHealth:
    """What the pool can do now (``/readyz``)."""

    num_workers: int
    """Workers configured."""
    num_ready: int
    """Workers alive with their imports done."""
    problems: tuple[str, ...]
    """Why the pool is not fully able to plan, in plain words (empty: it is)."""

    @property
    def ok(self) -> bool:
        """Every worker ready, no task past its deadline, the dispatcher running."""
        return not self.problems


@dataclass(slots=True)
class _Task:
    id: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    deadline_s: float | None
    future: Future[Any]
    running: bool = False
    reruns: int = 0
    started: float | None = None
    """``time.monotonic()`` when a worker was handed it (None: queued)."""


@dataclass(slots=True)
class _Worker:
    process: BaseProcess
    channel: Channel
    started: float
    ready: bool = False
    task: _Task | None = None
    killed_for: str | None = None
    """Why the pool killed it (its task fails with this)."""
    closed_at: float | None = None
    """When its socket was closed at shutdown."""
    eof_at: float | None = None
    """When its socket was first seen closed from the worker's side."""


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class SolverPool(Executor):
    """Spawned solver workers behind one non-blocking dispatcher (module docstring)."""

    def __init__(self, num_workers: int, *, grace_s: float = 2.0, nice: int = 0,
                 result_timeout_s: float = 30.0, start_timeout_s: float = 120.0, max_reruns: int = 1) -> None:
        """
        Args:
            num_workers: Worker processes kept alive.
            grace_s: Time past a task's deadline before its worker is killed.
            nice: Steps below the service's priority for every worker (0 to 19).
            result_timeout_s: Longest time a result frame may stay incomplete.
            start_timeout_s: Longest time a new worker may take to import the planner.
            max_reruns: Times a task whose worker died is run again before it fails.
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in [0, 19], got {nice}")
        self.num_workers = num_workers
        self.nice = nice
        self.grace_s = grace_s
        self.result_timeout_s = result_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_reruns = max_reruns
        self.num_replacements = 0
        """Workers started to replace one that exited."""
        self.num_deadline_kills = 0
        """Workers killed because their task ran past its deadline and grace."""
        self.num_reruns = 0
        """Tasks run again after their worker died."""
        self.deaths: deque[str] = deque(maxlen=64)
        """The latest workers' ends, in words."""
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.RLock()
        self._queue: deque[_Task] = deque()
        self._workers: list[_Worker] = []
        self._ids = itertools.count()
        self._closing = False
        self._kill_running = False
        self._startup_failures = 0
        self._next_start_at = 0.0
        self._heartbeat = time.monotonic()
        self._ended = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="solver-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue ``fn(*args, **kwargs)`` for the next idle worker."""
        return self._submit(None, fn, args, kwargs)

    def submit_with_deadline(self, deadline_s: float, fn: Callable[..., T], /, *args: Any,
                             **kwargs: Any) -> Future[T]:
        """Queue ``fn`` under a wall-clock deadline counted from when a worker is handed it.

        The future fails with :class:`DeadlineExceededError` at the deadline, or with
        :class:`WorkerDiedError` when the worker had to be killed ``grace_s`` later.
        """
        return self._submit(deadline_s, fn, args, kwargs)

    def _submit(self, deadline_s: float | None, fn: Callable[..., T], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.append(_Task(id=next(self._ids), fn=fn, args=args, kwargs=kwargs,
                                     deadline_s=deadline_s, future=future))
        self._wake()
        return future

    def health(self) -> PoolHealth:
        """Workers ready, tasks past their deadline, and whether the dispatcher runs."""
        now = time.monotonic()
        problems: list[str] = []
        with self._lock:
            num_ready = sum(1 for w in self._workers if w.ready and w.killed_for is None)
            for w in self._workers:
                t = w.task
                if t is not None and t.deadline_s is not None and t.started is not None \
                        and now > t.started + t.deadline_s:
                    problems.append(f"a solver task has run {now - t.started:.1f} s, past its "
                                    f"{t.deadline_s:.3g} s deadline (worker {w.process.pid})")
            heartbeat = self._heartbeat
            closing = self._closing
        if closing:
            problems.insert(0, "the solver pool is shut down")
        if num_ready < self.num_workers:
            problems.insert(0, f"{num_ready} of {self.num_workers} solver worker(s) ready")
        if now - heartbeat > STALL_S and self._thread.is_alive():
            problems.append(f"the solver pool's dispatcher has not run for {now - heartbeat:.1f} s")
        if not self._thread.is_alive() and not closing:
            problems.append("the solver pool's dispatcher stopped")
        return PoolHealth(num_workers=self.num_workers, num_ready=num_ready, problems=tuple(problems))

    def worker_pids(self) -> list[int]:
        """Pids of the pool's worker processes (starting ones included)."""
        with self._lock:
            return [w.process.pid for w in self._workers if w.process.pid is not None]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, kill_running: bool = False) -> None:
        """Stop the pool.

        Args:
            wait: Wait until the workers have exited (always bounded with ``kill_running``).
            cancel_futures: Cancel the tasks no worker was handed yet.
            kill_running: Kill the workers now: the tasks they run fail with ``BrokenProcessPool``
                (for a caller that awaits none of them: the service at its shutdown).
        """
        with self._lock:
            self._closing = True
            self._kill_running = self._kill_running or kill_running
            if cancel_futures or kill_running:
                while self._queue:
                    self._fail(self._queue.popleft(), PoolShutDownError("the solver pool shut down"))
        self._wake()
        if wait:
            self._thread.join(timeout=None if not kill_running else 2 * EXIT_WAIT_S + 5.0)

    # ------------------------------------------------------------ dispatcher
    def _wake(self) -> None:
        with self._lock, contextlib.suppress(BlockingIOError, OSError):
            if not self._ended:
                os.write(self._wake_w, b"x")

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException:
            logger.exception("the solver pool's dispatcher crashed")
        finally:
            self._close_all()

    def _step(self) -> bool:
        """One round: start, hand out, wait, read, enforce; False when the pool has ended."""
        self._heartbeat = time.monotonic()
        with self._lock:
            if self._closing:
                if not self._wind_down():
                    return False
            else:
                self._start_missing()
            self._hand_out()
            polled = self._poll_targets()
        events = self._poll(polled)
        with self._lock:
            for fd, mask in events:
                target = polled.get(fd)
                if target is None or target[0] not in self._workers:
                    continue
                worker, kind = target
                if kind == "sentinel":
                    self._read(worker)
                    self._on_exit(worker)
                    continue
                if mask & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._read(worker)  # the end of the socket sets channel.eof; the sentinel follows
                if mask & select.POLLOUT and not worker.channel.eof:
                    worker.channel.write_some()
            self._enforce_timers()
        return True

    def _poll_targets(self) -> dict[int, tuple[_Worker, str]]:
        targets: dict[int, tuple[_Worker, str]] = {}
        for w in self._workers:
            targets[w.process.sentinel] = (w, "sentinel")
            if w.closed_at is None and not w.channel.eof:
                targets[w.channel.fd] = (w, "socket")
        return targets

    def _poll(self, targets: dict[int, tuple[_Worker, str]]) -> list[tuple[int, int]]:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd, (worker, kind) in targets.items():
            mask = select.POLLIN
            if kind == "socket" and worker.channel.wants_write:
                mask |= select.POLLOUT
            poller.register(fd, mask)
        events = poller.poll(POLL_S * 1000)
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass
        return [(fd, mask) for fd, mask in events if fd != self._wake_r]

    def _start_missing(self) -> None:
        now = time.monotonic()
        while len(self._workers) < self.num_workers and now >= self._next_start_at:
            parent, child = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(target=worker_main, args=(child, os.getpid(), self.nice),
                                        name="dcp-solver", daemon=True)
            try:
                process.start()
            except OSError as exc:  # out of processes or memory: try again later
                logger.warning("could not start a solver worker: %s", exc)
                parent.close()
                child.close()
                self._next_start_at = now + 1.0
                return
            child.close()  # the worker's end lives in the worker only: its death is our EOF
            self._workers.append(_Worker(process=process, channel=Channel(parent), started=now))

    def _hand_out(self) -> None:
        for worker in self._workers:
            if not self._queue:
                return
            if not worker.ready or worker.task is not None or worker.killed_for or worker.closed_at:
                continue
            while self._queue:
                task = self._queue.popleft()
                if not task.running and not task.future.set_running_or_notify_cancel():
                    continue  # cancelled while queued
                task.running = True
                try:
                    payload = pickle.dumps((task.id, task.deadline_s, task.fn, task.args, task.kwargs),
                                           protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    self._fail(task, exc)
                    continue
                task.started = time.monotonic()
                worker.task = task
                worker.channel.queue(payload)
                worker.channel.write_some()
                break

    def _read(self, worker: _Worker) -> None:
        if worker.closed_at is not None:
            return
        for data in worker.channel.read_frames():
            try:
                message = pickle.loads(data)
            except Exception as exc:
                message = (worker.task.id if worker.task else -1, False,
                           RuntimeError(f"a solver result could not be read: {type(exc).__name__}: {exc}"))
            if message[0] == READY:
                worker.ready = True
                self._startup_failures = 0
                continue
            task_id, ok, value = message
            task = worker.task
            if task is None or task.id != task_id:
                continue
            worker.task = None
            if ok:
                with contextlib.suppress(InvalidStateError):
                    task.future.set_result(value)
            else:
                self._fail(task, value)

    def _on_exit(self, worker: _Worker) -> None:
        if worker not in self._workers:
            return
        worker.process.join(timeout=1.0)  # its sentinel fired: reaped at once
        how = worker.killed_for or _how_it_ended(worker.process.exitcode)
        self._workers.remove(worker)
        worker.channel.close()
        task = worker.task
        if self._closing:
            if task is not None:
                self._fail(task, PoolShutDownError("the solver pool shut down"))
            return
        self.deaths.append(f"worker {worker.process.pid}: {how}")
        self.num_replacements += 1
        if not worker.ready:
            self._startup_failures += 1
            self._next_start_at = time.monotonic() + min(0.1 * 2 ** self._startup_failures, 5.0)
        logger.warning("solver worker %s died (%s)%s; starting a new one", worker.process.pid, how,
                       "" if task is None else " while running a task")
        if task is None:
            return
        if worker.killed_for is None and task.reruns < self.max_reruns:
            task.reruns += 1
            task.started = None
            self.num_reruns += 1
            self._queue.appendleft(task)
            return
        runs = "" if worker.killed_for else f" (run {task.reruns + 1} time(s))"
        self._fail(task, WorkerDiedError(f"solver worker {worker.process.pid} ended while running this "
                                         f"task: {how}{runs}"))

    def _enforce_timers(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.killed_for is not None or w.closed_at is not None:
                continue
            t = w.task
            if w.channel.eof and w.eof_at is None:
                w.eof_at = now
            if w.channel.partial_since is not None and now - w.channel.partial_since > self.result_timeout_s:
                self._kill(w, f"its result stopped arriving halfway for over {self.result_timeout_s:g} s")
            elif (t is not None and t.deadline_s is not None and t.started is not None
                  and w.channel.partial_since is None and now > t.started + t.deadline_s + self.grace_s):
                self.num_deadline_kills += 1
                self._kill(w, f"the task ran {self.grace_s:g} s past its {t.deadline_s:.3g} s deadline "
                              "without stopping; its worker was killed")
            elif w.channel.eof and now - (w.eof_at or now) > 1.0:
                self._kill(w, "it closed its socket but did not exit")
            elif not w.ready and now - w.started > self.start_timeout_s:
                self._kill(w, f"it did not finish starting within {self.start_timeout_s:g} s")

    def _kill(self, worker: _Worker, why: str) -> None:
        logger.log(logging.INFO if self._closing else logging.WARNING, "killing solver worker %s: %s",
                   worker.process.pid, why)
        worker.killed_for = why
        with contextlib.suppress(OSError, ValueError, AttributeError):
            worker.process.kill()

    def _fail(self, task: _Task, error: BaseException) -> None:
        if not task.running and not task.future.set_running_or_notify_cancel():
            return
        task.running = True
        with contextlib.suppress(InvalidStateError):
            task.future.set_exception(error)

    def _wind_down(self) -> bool:
        """Shutdown: kill or drain the workers; False once none is left."""
        now = time.monotonic()
        for w in self._workers:
            if self._kill_running and w.killed_for is None:
                self._kill(w, "the solver pool shut down")
            elif w.task is None and not self._queue and w.closed_at is None:
                w.closed_at = now
                w.channel.close()  # the worker reads the end and exits
            elif w.closed_at is not None and now - w.closed_at > EXIT_WAIT_S and w.killed_for is None:
                self._kill(w, "it did not exit at shutdown")
        return bool(self._workers)

    def _close_all(self) -> None:
        with self._lock:
            self._closing = True
            for w in list(self._workers):
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    w.process.kill()
                w.process.join(timeout=2.0)
                if w.closed_at is None:
                    w.channel.close()
                if w.task is not None:
                    self._fail(w.task, PoolShutDownError("the solver pool shut down"))
            self._workers.clear()
            while self._queue:
                self._fail(self._queue.popleft(), PoolShutDownError("the solver pool shut down"))
            self._ended = True
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)


def make_executor(num_workers: int, *, nice: int = 0) -> SolverPool:
    """A solver pool of ``num_workers`` spawned processes (safe next to the server's threads) that
    exit with their parent, each ``nice`` steps below the parent's priority."""
    return SolverPool(num_workers, nice=nice)
