"""Solver workers that cannot be poisoned and a service that gets ready after losing one at start
(issue 24 items 1 and 2), with real pools and a real ``dcp serve``."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest

from api.pool import WORKER_MODULES, SolverPool


def _loaded_before_any_import() -> list[str]:
    return [name for name in WORKER_MODULES if name not in sys.modules]


def _fails_to_import() -> None:
    raise ImportError("cannot import name 'x' from partially initialized module 'pandas'")


def test_workers_import_everything_before_their_first_task() -> None:
    pool = SolverPool(1)
    try:
        assert pool.submit_with_deadline(30.0, _loaded_before_any_import).result(timeout=120) == []
    finally:
        pool.shutdown()


def test_a_worker_whose_import_broke_is_replaced() -> None:
    pool = SolverPool(1)
    try:
        with pytest.raises(ImportError):
            pool.submit_with_deadline(30.0, _fails_to_import).result(timeout=120)
        deadline = time.monotonic() + 60
        while True:  # the worker leaves; the next submissions get a fresh pool that works
            try:
                assert pool.submit_with_deadline(30.0, os.getpid).result(timeout=120) > 0
                if pool.num_replacements >= 1:
                    break
            except BrokenProcessPool:
                pass
            assert time.monotonic() < deadline, "the broken worker was never replaced"
            time.sleep(0.1)
    finally:
        pool.shutdown()


@pytest.mark.timeout(180)
def test_readyz_recovers_when_a_worker_is_killed_during_start_up(server_factory: Any) -> None:
    server = server_factory(workers=2)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            server.start()  # waits for /readyz 200 (60 s at most)
        except BaseException as exc:
            errors.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    killed = None
    deadline = time.monotonic() + 30
    while killed is None and time.monotonic() < deadline:
        if server.proc is not None:
            workers = server.solver_workers()
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                killed = workers[0]
        time.sleep(0.02)
    starter.join(timeout=90)
    assert killed is not None, "no pool worker seen"
    assert not errors, errors
    assert server.request("GET", "/readyz").status_code == 200


def test_a_deadline_miss_is_transient_and_the_retry_gets_more_room() -> None:
    from api.faults import classify
    from api.job_manager import RetryPolicy
    from api.pool import DeadlineExceededError

    fault = classify(DeadlineExceededError("stopped after its deadline of 3 s"))
    assert fault.transient and fault.kind == "deadline"
    policy = RetryPolicy(deadline_margin_s=1.0)
    assert [policy.margin_s(a) for a in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert RetryPolicy(deadline_margin_s=None).margin_s(3) is None
