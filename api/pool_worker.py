"""The solver pool's worker process: start-up, the task loop, and the in-worker deadline.

A worker owns one end of a socket pair to the service (``api.pool.SolverPool``). It imports the
planner first (:func:`preload`), says it is ready, then loops: read one task frame, run it, write
one result frame. Nothing else is shared with the service or with the other workers: no lock,
no queue, no pipe written by several processes. A worker killed at any moment, even halfway
through writing a result, leaves no lock held and no channel that another worker needs; the
service sees the end of its socket and its process sentinel, and replaces it.

Deadlines are enforced here cooperatively: a ``SIGALRM`` timer interrupts the planner's Python
code at the deadline (every search loop of the planner is Python, so it stops within
milliseconds) and the task fails with :class:`DeadlineExceededError`. The service kills a worker
that stays past it (native code that never returns to Python).

Workers watch their parent: when the service dies (kill -9 included) they exit within about
``PARENT_POLL_S`` (or at once, when their socket reads the end). They ignore SIGINT and delay
SIGTERM by ``TERM_GRACE_S``: a terminal's Ctrl-C and a service manager's stop signal the whole
process group, and a worker that died of it first made the service's shutdown look like "a
solver worker died"; the service stops its jobs, then its pool, and the workers leave with it.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

PARENT_POLL_S = 0.5
"""How often a worker checks that the service that started it is alive."""

TERM_GRACE_S = 5.0
"""How long a worker outlives a SIGTERM (module docstring): time for the service, signalled with
it, to stop its jobs first."""

READY = "ready"
"""The first message of a worker, once its imports are done: ``(READY, pid)``."""

WORKER_MODULES = ("planner.planning", "planner.epoch", "planner.bounds.lp", "planner.search.cpsat",
                  "planner.search.lns", "scipy.optimize", "ortools.sat.python.cp_model")
"""What a worker imports before its first task: everything the planner imports lazily (OR-Tools,
SciPy's MILP and what they pull in). A deadline alarm that lands inside a C extension's import
leaves it half-initialised in ``sys.modules`` and breaks that worker for every later task;
imported here, before any alarm is armed, no task imports anything heavy."""


class DeadlineExceededError(Exception):
    """A task ran past its wall-clock deadline and was stopped."""


class _Alarm(BaseException):
    """Raised in the worker by the SIGALRM handler (BaseException: no ``except Exception`` in
    the planner can swallow it)."""


def preload() -> None:
    """Import :data:`WORKER_MODULES` (idempotent)."""
    for name in WORKER_MODULES:
        importlib.import_module(name)


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


def init_worker(parent_pid: int, nice: int = 0) -> None:
    """Exit when the parent dies; leave SIGINT and SIGTERM to the parent; lower the priority by
    ``nice``; import the planner up front."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops its workers (module docstring)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if nice > 0 and hasattr(os, "nice"):
        os.nice(nice)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    preload()


def run_with_deadline(deadline_s: float, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in this (worker) process, interrupting it after ``deadline_s`` seconds.

    Raises:
        DeadlineExceededError: when the deadline passed first.
    """

    def on_alarm(signum: int, frame: object) -> None:
        raise _Alarm()

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


def _result_payload(task_id: int, ok: bool, value: Any) -> bytes:
    """The pickled ``(task_id, ok, value)``; an unpicklable value or error becomes a RuntimeError."""
    try:
        return pickle.dumps((task_id, ok, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        what = "result" if ok else f"error ({type(value).__name__}: {value})"[:500]
        return pickle.dumps((task_id, False, RuntimeError(f"the task's {what} could not be pickled: {exc}")))


def worker_main(conn: Connection, parent_pid: int, nice: int) -> None:
    """The worker process: ready message, then one result frame per task frame until the end.

    A task frame is the pickled ``(task_id, deadline_s or None, fn, args, kwargs)``; a result frame
    the pickled ``(task_id, ok, value or exception)``. A task that failed to import something
    leaves this worker right after its error is sent: the service replaces it instead of keeping
    a worker whose imports broke.
    """
    init_worker(parent_pid, nice)
    conn.send_bytes(pickle.dumps((READY, os.getpid())))
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the service closed its end (shutdown) or died
        task_id, deadline_s, fn, args, kwargs = pickle.loads(frame)
        broken_import = False
        try:
            value = fn(*args, **kwargs) if deadline_s is None else run_with_deadline(deadline_s, fn, *args, **kwargs)
            payload = _result_payload(task_id, True, value)
        except ImportError as exc:
            logger.error("an import failed inside a solver task: this worker is replaced")
            broken_import = True
            payload = _result_payload(task_id, False, exc)
        except BaseException as exc:  # the task's own error, sent back (KeyboardInterrupt is ignored here)
            payload = _result_payload(task_id, False, exc)
        try:
            conn.send_bytes(payload)
        except OSError:
            os._exit(0)
        if broken_import:
            os._exit(70)
