"""Step timing on one rank and the reporter's behaviour when the service is down."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from executor.client import PlannerClient, RetryPolicy
from executor.measure import MeasurementReporter, ReporterConfig, StepMeasurement, StepTimer
from tests.executor.helpers import make_plan, s1d


def _rank_plan(step: int, num_micro_batches: int):  # type: ignore[no-untyped-def]
    micro = [[(s1d(f"s{step}-{i}", 8), 0)] for i in range(num_micro_batches)]
    return make_plan([([0], micro)], num_ranks=1, step=step).rank_view(0)


def test_timer_reports_each_micro_batch_of_each_step_after_it_ends() -> None:
    got: list[StepMeasurement] = []
    timer = StepTimer(rank=0, sink=got.append)
    sleeps_s = [0.02, 0.005, 0.01]
    brackets_s: list[list[float]] = []
    for step in range(3):
        plan = _rank_plan(step, len(sleeps_s))
        timer.begin_step(plan, step=step)
        assert [m.step for m in got] == list(range(step))  # the previous step closes here
        brackets_s.append([])
        for pause in sleeps_s:
            outer = time.perf_counter()
            timer.start()
            time.sleep(pause)
            timer.stop()
            brackets_s[-1].append(time.perf_counter() - outer)
    timer.flush()
    assert [m.step for m in got] == [0, 1, 2]
    for m, brackets in zip(got, brackets_s, strict=True):
        assert m.peak_bytes is None and m.rank == 0 and len(m.plan_digest) == 64
        # Each time is its own micro-batch's: at least its sleep, at most the span this test
        # measured around start() and stop() (judged by the clocks' order, not by the machine's speed).
        for measured, pause, bracket in zip(m.micro_batch_times_s, sleeps_s, brackets, strict=True):
            assert pause <= measured <= bracket, (pause, measured, bracket)


def test_timer_skips_a_step_that_did_not_run_all_its_micro_batches(caplog: pytest.LogCaptureFixture) -> None:
    got: list[StepMeasurement] = []
    timer = StepTimer(rank=0, sink=got.append)
    timer.begin_step(_rank_plan(0, 2), step=0)
    timer.start()
    timer.stop()
    with caplog.at_level(logging.WARNING):
        timer.flush()
    assert got == [] and "ran 1 of its 2 micro-batches" in caplog.text


def test_reporter_drops_after_retries_when_the_service_is_down(caplog: pytest.LogCaptureFixture) -> None:
    # A service that takes connections and never answers: every post attempt hangs to its
    # deadline, so no batch can be posted or dropped before 2 attempts x 1 s have passed.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        client = PlannerClient(f"http://127.0.0.1:{silent.getsockname()[1]}",
                               retry=RetryPolicy(deadline_s=1.0, initial_backoff_s=0.01, request_timeout_s=1.0))
        reporter = MeasurementReporter(client, epoch_id="e", rank=0, config=ReporterConfig(
            batch_steps=2, flush_interval_s=0.05, post_deadline_s=1.0, max_attempts=2))
        with caplog.at_level(logging.WARNING):
            for step in range(3):
                reporter.submit(StepMeasurement(step=step, rank=0, plan_digest="0" * 64,
                                                micro_batch_times_s=(0.1,), peak_bytes=None))
            # Submitting never waits for the service: a submit that posted (or retried) in line
            # would return only once its batch was dropped.
            assert reporter.num_posted_steps == 0 and reporter.num_dropped_steps == 0
            reporter.close(timeout_s=30.0)
    client.close()
    assert reporter.num_posted_steps == 0 and reporter.num_dropped_steps == 3
    assert "not posted after 2 attempts; dropped" in caplog.text
