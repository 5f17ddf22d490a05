"""The solver process pool: replaced when broken, every task under a wall-clock deadline.

A ``ProcessPoolExecutor`` whose worker dies is unusable for good; ``SolverPool`` swaps in a
fresh one on the next submission, so one lost worker costs the requests in flight (a 503, or
an epoch job that retries its steps), not the service.

Deadlines (``submit_with_deadline``) are enforced twice:

* in the worker, cooperatively: a ``SIGALRM`` timer interrupts the planner's Python code at
  the deadline (every search loop of the planner is Python, so it stops within milliseconds)
  and the task fails with :class:`DeadlineExceededError`;
* in the service, as a backstop for code that never returns to Python (a native solver call
  past its own limit): ``grace_s`` after the deadline, the pool's workers are killed and the
  pool is replaced.

Workers also watch their parent: when the service dies (kill -9 included) they exit within
about ``PARENT_POLL_S`` instead of living on as orphans.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, ParamSpec, TypeVar

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

PARENT_POLL_S = 0.5
"""How often a worker checks that the service that started it is alive."""


class DeadlineExceededError(Exception):
    """A task ran past its wall-clock deadline and was stopped."""


class _Alarm(BaseException):
    """Raised in the worker by the SIGALRM handler (BaseException: no ``except Exception`` in
    the planner can swallow it)."""


_STARTS: Any = None
"""In a worker: the queue on which each deadline task reports ``(token, start unix time)``."""


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def init_worker(parent_pid: int, starts: Any = None, nice: int = 0) -> None:
    """Pool-worker initializer: exit when the parent dies; lower the priority by ``nice``;
    import the planner up front."""
    global _STARTS
    _STARTS = starts
    if nice > 0 and hasattr(os, "nice"):
        os.nice(nice)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    import planner.planning  # noqa: F401  (the first task must not pay for the import)


def run_with_deadline(token: int, deadline_s: float, fn: Callable[..., T], /, *args: Any,
                      **kwargs: Any) -> T:
    """Run ``fn`` in this (worker) process, interrupting it after ``deadline_s`` seconds.

    Raises:
        DeadlineExceededError: when the deadline passed first.
    """

    def on_alarm(signum: int, frame: object) -> None:
        raise _Alarm()

    if _STARTS is not None:
        _STARTS.put((token, time.time()))
    try:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, deadline_s)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    except _Alarm:
        raise DeadlineExceededError(f"stopped after its deadline of {deadline_s:.3g} s") from None


def make_executor(num_workers: int, *, starts: Any = None, nice: int = 0) -> ProcessPoolExecutor:
    """A pool of spawned processes (safe next to the server's threads) that exit with their
    parent, each ``nice`` steps below the parent's priority."""
    if not 0 <= nice <= 19:
        raise ValueError(f"nice must be in [0, 19], got {nice}")
    return ProcessPoolExecutor(max_workers=num_workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_worker, initargs=(os.getpid(), starts, nice))


class SolverPool(Executor):
    """An executor over a process pool that is recreated after it breaks."""

    def __init__(self, num_workers: int, *, grace_s: float = 2.0, nice: int = 0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.nice = nice
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._starts_queue = multiprocessing.get_context("spawn").SimpleQueue()
        self._executor = make_executor(num_workers, starts=self._starts_queue, nice=nice)
        self.num_replacements = 0
        self.num_deadline_kills = 0
        self._tokens = itertools.count()
        self._started: dict[int, float] = {}
        self._watched: dict[int, tuple[Future[Any], float, ProcessPoolExecutor]] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._read_starts, name="pool-starts", daemon=True).start()
        threading.Thread(target=self._watchdog, name="pool-watchdog", daemon=True).start()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Submit to the current pool, replacing it first when it is broken."""
        with self._lock:
            executor = self._executor
        try:
            return executor.submit(fn, *args, **kwargs)
        except BrokenProcessPool:
            with self._lock:
                if self._executor is executor:
                    logger.warning("solver pool broken (a worker died); starting a new one")
                    executor.shutdown(wait=False, cancel_futures=True)
                    self._executor = make_executor(self.num_workers, starts=self._starts_queue,
                                                   nice=self.nice)
                    self.num_replacements += 1
                executor = self._executor
            return executor.submit(fn, *args, **kwargs)

    def submit_with_deadline(self, deadline_s: float, fn: Callable[..., T], /, *args: Any,
                             **kwargs: Any) -> Future[T]:
        """Submit ``fn`` to run under a wall-clock deadline counted from when a worker starts it.

        The future fails with :class:`DeadlineExceededError` at the deadline, or with
        ``BrokenProcessPool`` when the backstop had to kill the workers ``grace_s`` later.
        """
        token = next(self._tokens)
        future: Future[T] = self.submit(run_with_deadline, token, deadline_s, fn, *args, **kwargs)
        with self._lock:
            self._watched[token] = (future, deadline_s, self._executor)
        return future

    def _read_starts(self) -> None:
        while not self._closed.is_set():
            try:
                token, started = self._starts_queue.get()
            except (EOFError, OSError):
                return
            with self._lock:
                if token in self._watched:
                    self._started[token] = started

    def _watchdog(self) -> None:
        while not self._closed.wait(0.2):
            now = time.time()
            overdue: list[tuple[float, ProcessPoolExecutor]] = []
            with self._lock:
                for token, (future, deadline_s, executor) in list(self._watched.items()):
                    if future.done():
                        del self._watched[token]
                        self._started.pop(token, None)
                    elif token in self._started and now > self._started[token] + deadline_s + self.grace_s:
                        overdue.append((deadline_s, executor))
                        del self._watched[token]
                        self._started.pop(token, None)
            for deadline_s, executor in overdue:
                logger.warning("a solver task is %.1f s past its %.3g s deadline and did not stop; "
                               "killing the pool's workers (the pool is replaced)", self.grace_s, deadline_s)
                self.num_deadline_kills += 1
                _kill_workers(executor)

    def worker_pids(self) -> list[int]:
        """Pids of the current pool's live workers."""
        processes: dict[int, Any] = getattr(self._executor, "_processes", None) or {}
        return [p.pid for p in processes.values() if p.is_alive()]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Shut the current pool down."""
        self._closed.set()
        with self._lock:
            self._executor.shutdown(wait=wait, cancel_futures=cancel_futures)


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    processes: dict[int, Any] = getattr(executor, "_processes", None) or {}
    for process in list(processes.values()):
        with contextlib.suppress(OSError, ValueError):
            process.kill()
