"""The solver pool on real spawned workers: killed workers never wedge it (at any moment, halfway
through a result included), their tasks run again or fail naming why, health tells the truth,
and the deadline backstop still fires after a worker was replaced."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

from api.pool import DeadlineExceededError, SolverPool, WorkerDiedError

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


def _die_mid_result(marker: str | None = None) -> str:
    """Write a result frame's header and part of its body on this worker's socket, then SIGKILL
    this worker: the service has read the header of a large result whose body never comes (the
    out-of-memory killer's doing). With ``marker``, only the first run dies (the file is made)."""
    import gc
    import pathlib
    import struct
    from multiprocessing.connection import Connection

    if marker is not None:
        path = pathlib.Path(marker)
        if path.exists():
            return "second run"
        path.touch()
    (conn,) = [o for o in gc.get_objects() if isinstance(o, Connection) and not o.closed]
    os.write(conn.fileno(), struct.pack("!i", 80_000) + b"x" * 30_000)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


def _result_or_none(future: Future[int]) -> int | None:
    """The task's value; None when it failed because the pool broke under it. Waits as long as
    the task takes (a slow machine only takes longer): a wedged pool meets the test's timeout."""
    try:
        return future.result()
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
                value = _result_or_none(pool.submit_with_deadline(10.0, _noop, kill))
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
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        for _ in range(3):
            if _result_or_none(pool.submit_with_deadline(30.0, _noop, 2)) == 2:
                break
        with pytest.raises(DeadlineExceededError):  # the cooperative stop
            pool.submit_with_deadline(0.3, _sleep, 30.0).result(timeout=30)
        # The backstop: 0.3 s + 0.5 s grace, then killed. Judged by order, not by a bound on the
        # clock: the task returns "finished" after 30 s, so a broken pool (not that result) and
        # one deadline kill show the backstop ended it before its own end.
        with pytest.raises(BrokenProcessPool):
            pool.submit_with_deadline(0.3, _ignores_alarm, 30.0).result()
        assert pool.num_deadline_kills == 1
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_a_worker_killed_halfway_through_a_result_is_replaced_and_its_task_run_again(tmp_path: Any) -> None:
    pool = SolverPool(1, max_reruns=1)
    try:
        assert pool.submit(_noop, 1).result(timeout=120) == 1
        first = pool.worker_pids()
        # Run again on the replacement worker: the second run returns.
        assert pool.submit(_die_mid_result, str(tmp_path / "ran")).result(timeout=120) == "second run"
        assert pool.num_reruns == 1 and pool.num_replacements == 1
        assert not set(pool.worker_pids()) & set(first)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_a_task_whose_worker_dies_on_every_run_fails_naming_how() -> None:
    pool = SolverPool(1, max_reruns=1)
    try:
        with pytest.raises(WorkerDiedError, match="SIGKILL"):
            pool.submit(_die_mid_result).result(timeout=120)
        assert pool.num_reruns == 1
        assert pool.submit(_noop, 3).result(timeout=120) == 3  # replaced again, and it works
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_health_reports_lost_workers_and_recovers() -> None:
    pool = SolverPool(2)
    try:
        assert pool.submit(_noop, 1).result(timeout=120) == 1
        deadline = time.monotonic() + 120
        while not pool.health().ok:  # both workers finish their imports
            assert time.monotonic() < deadline, pool.health()
            time.sleep(0.05)
        for pid in pool.worker_pids():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pool.health().ok:  # seen by the sentinels
            assert time.monotonic() < deadline, "the lost workers were never noticed"
            time.sleep(0.01)
        assert any("solver worker(s) ready" in p for p in pool.health().problems), pool.health()
        deadline = time.monotonic() + 120
        while not pool.health().ok:
            assert time.monotonic() < deadline, pool.health()
            time.sleep(0.05)
        assert pool.health().num_ready == 2
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def test_shutdown_with_kill_running_fails_running_tasks_and_returns() -> None:
    pool = SolverPool(1)
    assert pool.submit(_noop, 1).result(timeout=120) == 1
    running = pool.submit(_ignores_alarm, 600.0)
    time.sleep(0.2)
    pool.shutdown(wait=True, kill_running=True)
    with pytest.raises(BrokenProcessPool):
        running.result(timeout=30)
    assert not pool.worker_pids()


def test_health_reports_a_task_past_its_deadline_until_its_worker_is_replaced() -> None:
    pool = SolverPool(1, grace_s=3.0)
    try:
        assert pool.submit(_noop, 1).result(timeout=120) == 1
        stuck = pool.submit_with_deadline(0.2, _ignores_alarm, 60.0)
        deadline = time.monotonic() + 60
        while not any("past its" in p for p in pool.health().problems):
            assert time.monotonic() < deadline, pool.health()
            time.sleep(0.02)
        with pytest.raises(WorkerDiedError, match="deadline"):
            stuck.result(timeout=120)  # the backstop killed its worker
        deadline = time.monotonic() + 120
        while not pool.health().ok:
            assert time.monotonic() < deadline, pool.health()
            time.sleep(0.05)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
