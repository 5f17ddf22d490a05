"""Chaos on a real ``dcp serve``: random SIGKILLs of one or both solver workers at random moments
while two epochs are planned, then a SIGKILL of the whole server and a restart. Judged on
outcomes, never on wall time (a loaded 2-core box must pass): no hang, every job ends ``done``
with the digests of a clean run (nothing lost, nothing duplicated), ``/readyz`` turns 503 naming
the lost workers after each kill and 200 again once they are replaced, and a synchronous plan is
answered after each recovery."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import httpx
import pytest

from .conftest import COST_MODEL, FAST, Server, alive, manifest_lines
from .test_server import _digests, _wait

pytestmark = pytest.mark.timeout(900)

STEPS = 40
PER_STEP = 32
KILLS = 6


def _epoch(epoch_id: str, *, per_step: int = PER_STEP, steps: int = STEPS) -> dict[str, Any]:
    return {"epoch_id": epoch_id, "manifest_jsonl": manifest_lines(per_step * steps, seed=9),
            "batch": {"samples_per_step": per_step}, "seed": 5, "cluster": "h200x8",
            "cost_model_id": COST_MODEL, "options": FAST}


def wait_readiness(server: Server, *, ready: bool, timeout_s: float) -> dict[str, Any]:
    """Poll ``/readyz`` until it is 200 (``ready``) or 503 with reasons; its last body."""
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = httpx.get(f"{server.url}/readyz", timeout=30)
        body = response.json()
        if (response.status_code == 200) == ready and (ready or "reasons" in str(body)):
            return body
        time.sleep(0.02)
    raise AssertionError(f"/readyz never {'ready' if ready else 'not ready'}: {body}")


def test_random_worker_kills_and_a_server_kill_lose_and_duplicate_nothing(server_factory: Any) -> None:
    rng = random.Random(34)
    server = server_factory(workers=2, env={"DCP_JOB_MAX_BACKOFF_S": "2"}).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("ref")).status_code == 202
    assert _wait(server, "ref")["state"] == "done"
    reference = _digests(server, "ref", STEPS)

    assert server.request("POST", "/v1/epochs", json=_epoch("chaos")).status_code == 202
    body = {"samples": [{"id": f"p{i}", "tokens": 1024 * (i + 1)} for i in range(8)], "cluster": "h200x8",
            "cost_model_id": COST_MODEL, "options": FAST}
    for kill in range(KILLS):
        time.sleep(rng.uniform(0.0, 1.5))
        pids = server.solver_workers()
        assert pids, "no solver worker to kill"
        victims = pids if kill % 2 == 0 else [rng.choice(pids)]  # both workers every other time
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        lost = wait_readiness(server, ready=False, timeout_s=60)  # seen by the sentinels at once
        assert any("solver worker(s) ready" in r for r in lost["detail"]["reasons"]), lost
        wait_readiness(server, ready=True, timeout_s=300)  # replaced
        assert not any(alive(pid) for pid in victims), "a killed worker was not reaped"
        assert server.request("POST", "/v1/plans", json=body).status_code == 200  # the pool plans again
        status = server.request("GET", "/v1/epochs/chaos").json()
        assert status["state"] in ("queued", "running", "done"), status

    # The server itself, mid-epoch (a second job under way), then a restart: the jobs resume.
    assert server.request("POST", "/v1/epochs", json=_epoch("after")).status_code == 202
    _wait(server, "after", until=1)
    server.kill9()
    again = server_factory(workers=2).start()
    for epoch_id in ("chaos", "after"):
        status = _wait(again, epoch_id)
        assert status["state"] == "done", status
        assert _digests(again, epoch_id, STEPS) == reference, epoch_id
    listed = again.request("GET", "/v1/epochs/chaos/steps", params={"start": 0, "stop": STEPS}).json()
    assert [r["step"] for r in listed] == list(range(STEPS))  # each step once


def test_sigterm_stops_the_service_even_when_its_workers_never_answer(server_factory: Any) -> None:
    server = server_factory(workers=2).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("e", steps=200)).status_code == 202
    _wait(server, "e", until=1)
    for pid in server.solver_workers():
        os.kill(pid, signal.SIGSTOP)  # alive, holding their steps, never answering
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=120) in (0, -signal.SIGTERM), server.log.read_text()[-3000:]
    assert "planner service stopped" in server.log.read_text()
