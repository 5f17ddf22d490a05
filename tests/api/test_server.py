"""End to end through a real uvicorn server in a subprocess: start, request, SIGTERM, restart,
kill -9 in the middle of an epoch and resume with identical results."""

from __future__ import annotations

import time
from typing import Any

import pytest

from planner.plan import Plan, RankPlan

from .conftest import COST_MODEL, FAST, Server, manifest_lines

pytestmark = pytest.mark.timeout(180)

STEPS = 40
"""The kill and the SIGTERM land a moment after the first writes, with over 30 steps (~0.4 s each
on 2 cores) still to plan."""


def _epoch(epoch_id: str, manifest: str, per_step: int) -> dict[str, Any]:
    return {"epoch_id": epoch_id, "manifest_jsonl": manifest, "batch": {"samples_per_step": per_step},
            "seed": 11, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}


def _wait(server: Server, epoch_id: str, *, until: int | None = None) -> dict[str, Any]:
    """The job's status once ``until`` steps are stored (or it ended); judged by the job's progress,
    not by a deadline: a slow machine only takes longer (the suite's timeout guards against a hang)."""
    while True:
        status = server.request("GET", f"/v1/epochs/{epoch_id}").json()
        if until is not None and status["steps_done"] >= until:
            return status
        if status["state"] not in ("queued", "running"):
            assert until is None, f"epoch {epoch_id} ended before {until} steps: {status}"
            return status
        time.sleep(0.05)


def _digests(server: Server, epoch_id: str, steps_total: int) -> list[str]:
    out: list[str] = []
    for start in range(0, steps_total, 256):
        rows = server.request("GET", f"/v1/epochs/{epoch_id}/steps",
                              params={"start": start, "stop": min(start + 256, steps_total)}).json()
        out += [r["digest"] for r in rows]
    return out


def _graceful_stop(server: Server) -> None:
    code = server.terminate()
    assert code in (0, -15), code  # uvicorn re-raises SIGTERM after its graceful shutdown
    assert "planner service stopped" in server.log.read_text()


def test_serve_plan_epoch_sigterm_restart(server_factory: Any) -> None:
    server = server_factory().start()
    samples = [{"id": f"b{i}", "tokens": 1024 * (i + 1)} for i in range(10)]
    response = server.request("POST", "/v1/plans", json={"samples": samples, "cluster": "h200x8",
                                                         "cost_model_id": COST_MODEL, "options": FAST})
    assert response.status_code == 200, response.text
    assert Plan.model_validate(response.json()["plan"]).digest() == response.json()["digest"]

    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(36), 12)).status_code == 202
    status = _wait(server, "e")
    assert status["state"] == "done" and status["steps_done"] == 3
    plans = {}
    for step in range(3):
        data = server.request("GET", f"/v1/epochs/e/steps/{step}").json()
        plans[step] = data["digest"]
        plan = Plan.model_validate(data["plan"])
        for rank in (0, 7):
            view = server.request("GET", f"/v1/epochs/e/steps/{step}/ranks/{rank}").json()
            assert RankPlan.model_validate(view) == plan.rank_view(rank)

    # Bad inputs: the right 4xx, nothing stored.
    assert server.request("POST", "/v1/epochs", json=_epoch("x", manifest_lines(4), 2),
                          headers={"Authorization": "Bearer nope"}).status_code == 401
    escape = {**_epoch("x", "", 2), "manifest_jsonl": None, "manifest_path": "../plans.sqlite"}
    assert server.request("POST", "/v1/epochs", json=escape).status_code == 400
    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(4), 2)).status_code == 409
    huge = _epoch("x", "x" * 2_000_000, 2)
    assert server.request("POST", "/v1/epochs", json=huge).status_code == 413
    assert server.request("GET", "/v1/epochs/e/steps/3").status_code == 404

    _graceful_stop(server)
    again = server_factory().start()
    assert [e["epoch_id"] for e in again.request("GET", "/v1/epochs").json()] == ["e"]
    for step, digest in plans.items():
        assert again.request("GET", f"/v1/epochs/e/steps/{step}").json()["digest"] == digest


def test_kill9_mid_epoch_resumes_identically(server_factory: Any) -> None:
    manifest = manifest_lines(12 * STEPS, seed=5)
    server = server_factory(workers=2).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("crash", manifest, 12)).status_code == 202
    before = _wait(server, "crash", until=6)
    assert before["steps_done"] < STEPS, "too fast to interrupt; grow the epoch"
    server.kill9()

    restarted = server_factory(workers=2).start()
    resumed = restarted.request("GET", "/v1/epochs/crash").json()
    assert resumed["steps_done"] >= before["steps_done"]  # nothing committed was lost
    final = _wait(restarted, "crash")
    assert final["state"] == "done" and final["steps_done"] == final["steps_total"] == STEPS

    # The same job run without interruption, on the same server.
    assert restarted.request("POST", "/v1/epochs", json=_epoch("ref", manifest, 12)).status_code == 202
    assert _wait(restarted, "ref")["state"] == "done"
    crash = _digests(restarted, "crash", STEPS)
    assert len(crash) == STEPS
    assert crash == _digests(restarted, "ref", STEPS)

    ids: list[str] = []
    for start in range(0, STEPS, 50):
        for row in restarted.request("GET", "/v1/epochs/crash/steps",
                                     params={"start": start, "stop": start + 50}).json():
            ids += Plan.model_validate(row["plan"]).sample_ids
    assert sorted(ids) == sorted(f"s{i}" for i in range(12 * STEPS))  # none lost, none duplicated

    # SIGTERM in the middle of a job: it is re-queued and finishes after the restart.
    assert restarted.request("POST", "/v1/epochs", json=_epoch("term", manifest, 12)).status_code == 202
    _wait(restarted, "term", until=3)
    _graceful_stop(restarted)
    third = server_factory(workers=2).start()
    assert third.request("GET", "/v1/epochs/term").json()["state"] in ("queued", "running", "done")
    assert _wait(third, "term")["state"] == "done"
    assert _digests(third, "term", STEPS) == crash
