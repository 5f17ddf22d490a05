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
about ``PARENT_POLL_S`` instead of living on as orphans. They ignore SIGINT and SIGTERM: a
terminal's Ctrl-C and a service manager's stop (systemd, ``docker stop``) signal the whole process
group, and a worker that died of it first made the service's shutdown look like "a solver worker
died" (Ctrl-C also printed each worker's ``KeyboardInterrupt`` and could hang the shutdown); the
service stops its jobs, then its pool, and the workers leave with it. A SIGTERM still ends a
worker, ``TERM_GRACE_S`` later (``ProcessPoolExecutor`` terminates the other workers of a broken
pool and waits for them), unless the service stopped it first.

Workers report when they start a deadline task over one pipe shared by every worker of every
pool the service makes, written without a lock: each report is one ``os.write`` of
``_START_RECORD.size`` bytes, which POSIX makes atomic on a pipe (at most ``PIPE_BUF``). A lock
would not survive a worker killed while holding it: every later report would wait on it for
good, and with them every task (a ``multiprocessing`` queue's lock did exactly that).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import os
import select
import signal
import struct
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
"""In a worker: the pipe's write end (a ``multiprocessing`` connection, which owns the
descriptor), on which each deadline task reports when it starts."""

_START_RECORD = struct.Struct("<qd")
"""One start report: the task's token and its start as unix time (16 bytes, atomic on a pipe)."""


TERM_GRACE_S = 5.0
"""How long a worker outlives a SIGTERM (module docstring): time for the service, signalled with
it, to stop its jobs first."""


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)


def _on_sigterm(signum: int, frame: object) -> None:
    """End this worker :data:`TERM_GRACE_S` after a SIGTERM (the task it runs goes on meanwhile)."""
    timer = threading.Timer(TERM_GRACE_S, os._exit, args=(128 + signal.SIGTERM,))
    timer.daemon = True
    timer.start()


def init_worker(parent_pid: int, starts: Any = None, nice: int = 0) -> None:
    """Pool-worker initializer: exit when the parent dies; leave SIGINT and SIGTERM to the parent;
    lower the priority by ``nice``; import the planner up front.

    Args:
        parent_pid: The service's pid.
        starts: The write end (a ``multiprocessing`` connection) of the pipe on which deadline
            tasks report their start, or None.
        nice: Steps below the parent's priority.
    """
    global _STARTS
    _STARTS = starts
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops its workers (module docstring)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if nice > 0 and hasattr(os, "nice"):
        os.nice(nice)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    preload()


WORKER_MODULES = ("planner.planning", "planner.epoch", "planner.bounds.lp", "planner.search.cpsat",
                  "planner.search.lns", "scipy.optimize", "ortools.sat.python.cp_model")
"""What a worker imports before its first task: everything the planner imports lazily (OR-Tools,
SciPy's MILP and what they pull in). A deadline alarm that lands inside a C extension's import
leaves it half-initialised in ``sys.modules`` and breaks that worker for every later task
(issue 24); imported here, before any alarm is armed, no task imports anything heavy."""


def preload() -> None:
    """Import :data:`WORKER_MODULES` (idempotent)."""
    import importlib

    for name in WORKER_MODULES:
        importlib.import_module(name)


def _exit_soon(delay_s: float = 0.05) -> None:
    """Leave this worker shortly after the current task's error is sent back: the pool breaks and
    the service replaces it (``SolverPool``) instead of keeping a worker whose imports broke."""
    threading.Timer(delay_s, os._exit, args=(70,)).start()


def run_with_deadline(token: int, deadline_s: float, fn: Callable[..., T], /, *args: Any,
                      **kwargs: Any) -> T:
    """Run ``fn`` in this (worker) process, interrupting it after ``deadline_s`` seconds.

    Raises:
        DeadlineExceededError: when the deadline passed first.
    """

    def on_alarm(signum: int, frame: object) -> None:
        raise _Alarm()

    if _STARTS is not None:
        os.write(_STARTS.fileno(), _START_RECORD.pack(token, time.time()))  # atomic: no lock to die holding
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
    except ImportError:
        logger.error("an import failed inside a solver task: this worker is replaced")
        _exit_soon()
        raise


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
        self._lock = threading.RLock()
        self._starts_read, self._starts_write = multiprocessing.get_context("spawn").Pipe(duplex=False)
        self._executor = make_executor(num_workers, starts=self._starts_write, nice=nice)
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
                    _kill_workers(executor)  # doomed (the pool terminates them): no SIGTERM grace
                    executor.shutdown(wait=False, cancel_futures=True)
                    self._executor = make_executor(self.num_workers, starts=self._starts_write,
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
        with self._lock:  # registered before the start report can be read (the reader waits)
            future: Future[T] = self.submit(run_with_deadline, token, deadline_s, fn, *args, **kwargs)
            self._watched[token] = (future, deadline_s, self._executor)
        return future

    def _read_starts(self) -> None:
        """The reader of the start pipe (it owns the read end and closes it when it stops)."""
        with self._starts_read:
            fd = self._starts_read.fileno()
            pending = b""
            while not self._closed.is_set():
                try:
                    ready, _, _ = select.select([fd], [], [], 0.2)
                    if not ready:
                        continue
                    data = os.read(fd, 4096)
                except (OSError, ValueError):
                    return
                if not data:
                    return
                pending += data
                whole = len(pending) - len(pending) % _START_RECORD.size
                with self._lock:
                    for token, started in _START_RECORD.iter_unpack(pending[:whole]):
                        if token in self._watched:
                            self._started[token] = started
                pending = pending[whole:]

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

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, kill_running: bool = False) -> None:
        """Shut the current pool down.

        Args:
            wait: Wait for the workers to exit.
            cancel_futures: Cancel the tasks not started yet.
            kill_running: Kill the workers first, so that tasks still running end now with
                ``BrokenProcessPool`` instead of being waited for: for a caller that awaits none
                of them (the service at shutdown, after its requests and jobs have ended, when
                what is left is a worker's warm-up import, ~1 s, or a plan whose client left).
        """
        self._closed.set()
        with self._lock:
            if kill_running:
                _kill_workers(self._executor)
            self._executor.shutdown(wait=wait, cancel_futures=cancel_futures)
        self._starts_write.close()


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    processes: dict[int, Any] = getattr(executor, "_processes", None) or {}
    for process in list(processes.values()):
        with contextlib.suppress(OSError, ValueError):
            process.kill()
