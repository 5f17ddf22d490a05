"""The solver process pool, replaced when broken (a worker killed, e.g. by the OOM killer).

A ``ProcessPoolExecutor`` whose worker dies is unusable for good; ``SolverPool`` swaps in a
fresh one on the next submission, so one lost worker costs the requests in flight (a 503, or
a failed job naming the cause), not the service.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, ParamSpec, TypeVar

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def make_executor(num_workers: int) -> ProcessPoolExecutor:
    """A pool of spawned processes (safe next to the server's threads)."""
    return ProcessPoolExecutor(max_workers=num_workers, mp_context=multiprocessing.get_context("spawn"))


class SolverPool(Executor):
    """An executor over a process pool that is recreated after it breaks."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._executor = make_executor(num_workers)
        self.num_replacements = 0

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
                    self._executor = make_executor(self.num_workers)
                    self.num_replacements += 1
                executor = self._executor
            return executor.submit(fn, *args, **kwargs)

    def worker_pids(self) -> list[int]:
        """Pids of the current pool's live workers."""
        processes: dict[int, Any] = getattr(self._executor, "_processes", None) or {}
        return [p.pid for p in processes.values() if p.is_alive()]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Shut the current pool down."""
        with self._lock:
            self._executor.shutdown(wait=wait, cancel_futures=cancel_futures)
