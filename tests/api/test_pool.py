"""The solver pool on real spawned workers: killed workers never wedge it, and the deadline
backstop (which needs each task's start report) still fires after a pool was replaced."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest

from api.pool import DeadlineExceededError, SolverPool

pytestmark = pytest.mark.timeout(180)


def _noop(value: int) -> int:
    return value


def _ignores_alarm(seconds: float) -> str:
    """Like native code that never returns to Python: the cooperative SIGALRM cannot stop it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(seconds)
    return "finished"


def _sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "finished"


def _die_holding_the_start_channel() -> None:
    """SIGKILL this worker while it holds the lock its start reports are written under, if the
    start channel has one (a ``multiprocessing`` queue's write lock did: issue 24 item 9)."""
    from api import pool

    for name in ("_wlock", "_rlock", "_lock"):
        lock = getattr(pool._STARTS, name, None)
        if lock is not None:
            lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def _result_within(future: Future[int], timeout_s: float) -> int | None:
    """The task's value; None when it failed because the pool broke under it."""
    try:
        return future.result(timeout=timeout_s)
    except BrokenProcessPool:
        return None


def test_workers_killed_at_any_moment_never_wedge_the_pool() -> None:
    # Tiny tasks keep the workers reporting starts nearly all the time, so kills land inside the
    # report (with a cross-process lock there, a worker killed holding it stopped every later task).
    pool = SolverPool(2, grace_s=1.0)
    rng = random.Random(5)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                futures = [pool.submit_with_deadline(10.0, _noop, i) for i in range(50)]
            except BrokenProcessPool:
                continue
            for f in futures:
                with contextlib.suppress(BrokenProcessPool):
                    f.result(timeout=60)

    flooder = threading.Thread(target=flood, daemon=True)
    try:
        assert pool.submit_with_deadline(30.0, _noop, 1).result(timeout=60) == 1  # workers up
        flooder.start()
        for kill in range(12):
            time.sleep(rng.uniform(0.05, 0.4))
            pids = pool.worker_pids()
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
            for _ in range(3):  # the first may fail with the pool that just broke
                value = _result_within(pool.submit_with_deadline(10.0, _noop, kill), 30.0)
                if value is not None:
                    break
            assert value == kill, f"no task completed after kill {kill}"
    finally:
        stop.set()
        flooder.join(timeout=60)
        pool.shutdown(wait=False, cancel_futures=True)
    assert not flooder.is_alive()
    assert pool.num_replacements >= 1


def test_deadline_backstop_kills_a_task_that_ignores_its_alarm_even_after_a_replacement() -> None:
    pool = SolverPool(1, grace_s=0.5)
    try:
        assert pool.submit_with_deadline(30.0, _noop, 1).result(timeout=60) == 1
        os.kill(pool.worker_pids()[0], signal.SIGKILL)  # the next pool gets the same start pipe
        for _ in range(3):
            if _result_within(pool.submit_with_deadline(30.0, _noop, 2), 30.0) == 2:
                break
        with pytest.raises(DeadlineExceededError):  # the cooperative stop
            pool.submit_with_deadline(0.3, _sleep, 30.0).result(timeout=30)
        start = time.monotonic()
        with pytest.raises(BrokenProcessPool):  # the backstop: 0.3 s + 0.5 s grace, then killed
            pool.submit_with_deadline(0.3, _ignores_alarm, 30.0).result(timeout=30)
        assert time.monotonic() - start < 15.0
        assert pool.num_deadline_kills == 1
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_a_worker_killed_holding_the_start_channel_does_not_stop_later_deadlines() -> None:
    pool = SolverPool(1, grace_s=0.5)
    try:
        assert pool.submit_with_deadline(30.0, _noop, 1).result(timeout=60) == 1
        with pytest.raises(BrokenProcessPool):
            pool.submit(_die_holding_the_start_channel).result(timeout=60)
        start = time.monotonic()
        for _ in range(3):  # the first may meet the pool that just broke
            with contextlib.suppress(BrokenProcessPool):
                assert pool.submit_with_deadline(30.0, _noop, 2).result(timeout=30) == 2
                break
        # The next deadline task starts, reports it, and the backstop fires on it.
        with pytest.raises(BrokenProcessPool):
            pool.submit_with_deadline(0.3, _ignores_alarm, 30.0).result(timeout=30)
        assert time.monotonic() - start < 30.0
        assert pool.num_deadline_kills == 1
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
