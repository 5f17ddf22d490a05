"""The plan client against a real ``dcp serve``: fetch, prefetch, outages, fallback, errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from executor.client import (
    PlannerClient,
    PlanPrefetcher,
    PlanRequestError,
    PlanUnavailableError,
    RetryPolicy,
)
from planner.epoch import BatchRule, make_steps, plan_samples, step_seed
from planner.plan import Plan
from tests.executor.service import OPTIONS, Service, running_service, start_epoch, tiny_manifest, tiny_setup

EPOCH = "client-test"
NUM_SAMPLES, PER_STEP, SEED = 24, 6, 3


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("service")) as svc:
        cluster, cost_model = tiny_setup()
        start_epoch(svc.url, epoch_id=EPOCH, samples=tiny_manifest(NUM_SAMPLES), samples_per_step=PER_STEP,
                    seed=SEED, cluster=cluster, cost_model=cost_model)
        yield svc


def _local_plan(step: int) -> Plan:
    """What the service would plan for ``step``: same batch rule, seed, cluster, cost model."""
    cluster, cost_model = tiny_setup()
    steps = make_steps(tiny_manifest(NUM_SAMPLES), rule=BatchRule(samples_per_step=PER_STEP), seed=SEED)
    result = plan_samples(steps[step], cluster=cluster, cost_model=cost_model, options=OPTIONS,
                          step=step, seed=step_seed(SEED, step))
    return Plan.model_validate_json(result.plan_json)


@pytest.mark.timeout(120)
def test_prefetcher_serves_every_rank_the_same_plan(service: Service) -> None:
    with PlannerClient(service.url, retry=RetryPolicy(deadline_s=10)) as client:
        whole, digest = client.step_plan(EPOCH, 1)
        views = []
        for rank in range(4):
            plans = PlanPrefetcher(client, epoch_id=EPOCH, rank=rank, depth=2, num_steps=4)
            views.append([plans.get(step) for step in range(4)])
            plans.close()
    assert [v[1].plan_digest for v in views] == [digest] * 4
    for rank in range(4):
        assert views[rank][1] == whole.rank_view(rank)
    planned = sorted(ps.sample.id for g in whole.groups for mb in g.micro_batches for ps in mb.samples)
    assert len(planned) == PER_STEP


@pytest.mark.timeout(180)
def test_outage_shorter_than_deadline_is_ridden_out_longer_one_is_a_clear_error(
        service: Service) -> None:
    client = PlannerClient(service.url, retry=RetryPolicy(deadline_s=20, max_backoff_s=0.5))
    plans = PlanPrefetcher(client, epoch_id=EPOCH, rank=1, depth=0, num_steps=4)
    before = plans.get(0)
    service.stop()
    restart = threading.Timer(2.0, service.start)
    restart.start()
    start = time.monotonic()
    during = plans.get(1)  # the service is down for at least 2 s of this call
    waited = time.monotonic() - start
    restart.join()
    assert waited >= 1.5
    assert during.step == 1 and during.rank == 1 and during.plan_digest != before.plan_digest

    service.stop()
    short = PlannerClient(service.url, retry=RetryPolicy(deadline_s=1.5, max_backoff_s=0.2))
    try:
        start = time.monotonic()
        with pytest.raises(PlanUnavailableError) as info:
            PlanPrefetcher(short, epoch_id=EPOCH, rank=1, depth=0).get(2)
        elapsed = time.monotonic() - start
        message = str(info.value)
        assert f"/v1/epochs/{EPOCH}/steps/2/ranks/1" in message
        assert "deadline" in message and "attempts" in message and "ConnectError" in message
        # Judged by structure: the deadline it gave up at is the policy's (the service stays down,
        # so a client that ignored it would never return); it waited at least that long.
        assert "within the 1.5 s deadline" in message, message
        assert elapsed >= 1.5, elapsed

        # With a local fallback the same step is planned in-process, identically.
        fallback = PlanPrefetcher(short, epoch_id=EPOCH, rank=1, depth=0, fallback=_local_plan)
        local = fallback.get(1)
        assert fallback.num_fallbacks == 1
        assert local == during  # same group, micro-batches, policies and digest as served
    finally:
        service.start()
        short.close()
        client.close()


def _retried_answers(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The client's "failed (HTTP ...); retrying" records: an answer after which it tried again (a
    connection refused while the service restarts after the test above is retried, rightly)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "executor.client" and "(HTTP " in r.getMessage() and "retrying" in r.getMessage()]


@pytest.mark.timeout(60)
def test_bad_request_fails_at_once(service: Service, caplog: pytest.LogCaptureFixture) -> None:
    """At once: on the first answer, not retried (judged by attempts, not by the clock)."""
    caplog.set_level(logging.DEBUG, logger="executor.client")
    with PlannerClient(service.url, retry=RetryPolicy(deadline_s=30)) as client, \
            pytest.raises(PlanRequestError, match="HTTP 422"):
        client.start_epoch({"epoch_id": "bad", "batch": {"samples_per_step": 2},
                            "cluster": "h200x8", "cost_model_id": "x"})
    assert _retried_answers(caplog) == []


@pytest.mark.timeout(60)
def test_unknown_epoch_or_step_fails_at_once(service: Service, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="executor.client")
    with PlannerClient(service.url, retry=RetryPolicy(deadline_s=30)) as client:
        with pytest.raises(PlanRequestError, match="HTTP 404: unknown epoch 'no-such-epoch'"):
            client.rank_plan("no-such-epoch", 0, 0)
        with pytest.raises(PlanRequestError, match="step 999 does not exist"):
            client.rank_plan(EPOCH, 999, 0)
    assert _retried_answers(caplog) == []


def test_retry_policy_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        RetryPolicy(deadline_s=0)
    with pytest.raises(ValueError, match="max_backoff_s"):
        RetryPolicy(initial_backoff_s=1.0, max_backoff_s=0.5)
