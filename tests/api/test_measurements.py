"""Measurements route, recalibration, revisions and frozen steps through the real app and pool."""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi.testclient import TestClient

from api.measurements_store import MeasurementStore, RankMeasurement
from api.store import PlanStore
from costmodel.schema import CostModelFile
from planner.plan import Plan, RankPlan

from .conftest import AUTH, COST_MODEL, FAST, ReadingClient, bytes_truth, group_peak_bytes, manifest_lines


def _epoch(client: TestClient, epoch_id: str, *, num_samples: int = 48) -> dict[str, Any]:
    body = {"epoch_id": epoch_id, "manifest_jsonl": manifest_lines(num_samples), "batch": {"samples_per_step": 8},
            "seed": 3, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    assert client.post("/v1/epochs", json=body, headers=AUTH).status_code == 202
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status = client.get(f"/v1/epochs/{epoch_id}").json()
        if status["state"] == "done":
            return dict(status)
        assert status["state"] in ("queued", "running"), status
        time.sleep(0.05)
    raise AssertionError("epoch not done")


def _view(client: TestClient, epoch_id: str, step: int, rank: int) -> RankPlan:
    """A rank's fetch (with the token: only those freeze the step)."""
    response = client.get(f"/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}", headers=AUTH)
    assert response.status_code == 200, response.text
    return RankPlan.model_validate_json(response.content)


def _plan(client: TestClient, epoch_id: str, step: int) -> tuple[Plan, str]:
    body = client.get(f"/v1/epochs/{epoch_id}/steps/{step}").json()
    return Plan.model_validate(body["plan"]), body["digest"]


def _recalibrated(client: TestClient, epoch_id: str, *, revisions: int = 1) -> dict[str, Any]:
    """The epoch's recalibration report once it has ``revisions`` revisions and no fit running."""
    deadline = time.monotonic() + 60
    while True:
        report: dict[str, Any] = client.get(f"/v1/epochs/{epoch_id}/recalibration").json()
        if len(report["revisions"]) >= revisions and not report["busy"]:
            return report
        assert time.monotonic() < deadline, report
        time.sleep(0.05)


def _measured(view: RankPlan, factor: float) -> dict[str, Any]:
    """What a rank would post if every micro-batch took ``factor`` times its prediction."""
    return {"step": view.step, "rank": view.rank, "plan_digest": view.plan_digest,
            "micro_batch_times_s": [factor * mb.predicted_time_s for mb in view.group.micro_batches],
            "peak_bytes": None}


def test_bad_measurements_are_refused_and_nothing_is_stored(client: TestClient) -> None:
    _epoch(client, "m1")
    _epoch(client, "m2", num_samples=16)
    good = _measured(_view(client, "m1", 0, 0), 1.0)
    path = "/v1/epochs/m1/measurements"

    def post(*steps: dict[str, Any]) -> Any:
        return client.post(path, json={"steps": list(steps)}, headers=AUTH)

    other = _measured(_view(client, "m2", 0, 0), 1.0)
    cases = [
        ({**good, "plan_digest": other["plan_digest"]}, 409, "not the digest of step 0"),
        ({**good, "step": 6}, 404, "has 6 steps; step 6 does not exist"),
        ({**good, "rank": 9}, 422, "rank 9 is not in the world"),
        ({**good, "micro_batch_times_s": [*good["micro_batch_times_s"], 0.1]}, 422, "micro-batches"),
        ({**good, "micro_batch_times_s": [-1.0] * len(good["micro_batch_times_s"])}, 422, "greater than 0"),
    ]
    for bad, code, reason in cases:
        response = post(good, bad)  # one bad step: the whole post is refused
        assert response.status_code == code, response.text
        assert reason in response.text
    nan = client.post(path, content=b'{"steps":[{"step":0,"rank":0,"plan_digest":"' + b"0" * 64
                      + b'","micro_batch_times_s":[NaN]}]}', headers={**AUTH, "content-type": "application/json"})
    assert nan.status_code == 422
    assert client.post("/v1/epochs/nope/measurements", json={"steps": [good]}, headers=AUTH).status_code == 404
    assert client.post(path, json={"steps": [good]}).status_code == 401
    report = client.get("/v1/epochs/m1/recalibration").json()
    assert report["measured_steps"] == 0 and report["steps"] == []

    first = post(good).json()
    assert first == {"stored": 1, "duplicates": 0, "recalibration": "off"}
    assert post(good).json()["duplicates"] == 1  # a retried post changes nothing
    statuses = [post(good).status_code for _ in range(60)]
    assert 429 in statuses  # a flood from one rank is rate-limited


def test_recalibration_publishes_a_revision_and_replans_only_unfetched_steps(client: TestClient) -> None:
    _epoch(client, "r1")
    before = {s: _plan(client, "r1", s) for s in range(6)}
    views = {(s, r): _view(client, "r1", s, r) for s in range(2) for r in range(8)}  # freezes 0..1
    settings = client.post("/v1/epochs/r1/recalibration", json={"follow": True, "every_steps": 2},
                           headers=AUTH)
    assert settings.status_code == 200 and settings.json()["frozen_through"] == 1
    steps = [_measured(view, 3.0) for view in views.values()]
    steps[0]["micro_batch_times_s"] = [30 * t for t in steps[0]["micro_batch_times_s"]]  # one straggler
    assert client.post("/v1/epochs/r1/measurements", json={"steps": steps}, headers=AUTH).json()["stored"] == 16
    report = _recalibrated(client, "r1")
    revision = report["revisions"][0]
    assert revision["ref"] == f"{COST_MODEL}@1" and report["current_ref"] == revision["ref"]
    # Every prediction was 3x too fast (one step 90x, a straggler): the fit predicts the rest.
    assert math.isclose(revision["scales"]["compute"], 3.0, rel_tol=0.1), revision
    assert revision["fit"]["train_mape_before"] > 0.6 and revision["fit"]["train_mape_after"] < 0.05
    assert [e["rev"] for e in report["steps"]] == [0, 0]
    for step, (plan, digest) in before.items():
        after, after_digest = _plan(client, "r1", step)
        assert sorted(after.sample_ids) == sorted(plan.sample_ids)  # samples per step never change
        if step <= 1:
            assert after_digest == digest  # fetched: frozen
        else:
            assert after.cost_model_id == f"{COST_MODEL}@1"
            assert after.predicted_step_time_s > 2.5 * plan.predicted_step_time_s
    file = client.get(f"/v1/cost-models/{COST_MODEL}/revisions/1").json()
    assert file["id"] == f"{COST_MODEL}@1"
    assert client.get(f"/v1/cost-models/{COST_MODEL}/revisions/2").status_code == 404
    metrics = client.get("/metrics").text
    assert 'dcp_epoch_cost_model_revision{epoch_id="r1"} 1.0' in metrics
    assert "dcp_cost_model_term_ratio" in metrics


def test_measured_peaks_recalibrate_the_memory_model_and_replanned_steps_use_it(client: TestClient) -> None:
    """Ranks (CUDA ones) report each step's peak: the service fits the factor on the bytes per
    token, the revision carries it, and re-planned steps keep their groups under it."""
    _epoch(client, "p1")
    views = {(s, r): _view(client, "p1", s, r) for s in range(2) for r in range(8)}  # freezes 0..1
    assert client.post("/v1/epochs/p1/recalibration", json={"follow": True, "every_steps": 2},
                       headers=AUTH).status_code == 200
    truth = bytes_truth(client, 1.5)  # every per-token byte 1.5x what the model says
    act = CostModelFile.model_validate(client.get(f"/v1/cost-models/{COST_MODEL}").json()).activation
    steps = []
    for view in views.values():
        measured = _measured(view, 1.0)
        if view.group.micro_batches:
            # step 0's ranks report 0 (no allocator peak): left out, not a failed fit
            measured["peak_bytes"] = 0 if view.step == 0 else int(group_peak_bytes(truth, view.group))
        steps.append(measured)
    assert client.post("/v1/epochs/p1/measurements", json={"steps": steps}, headers=AUTH).json()["stored"] == 16
    report = _recalibrated(client, "p1")
    revision = report["revisions"][0]
    memory = revision["fit"]["memory"]
    assert memory["fitted"] and memory["num_points"] > 0, memory
    assert math.isclose(revision["scales"]["activation"], 1.5, rel_tol=1e-6), revision
    assert memory["max_under_before"] > 0.05 and memory["max_under_after"] <= 1e-6
    file = CostModelFile.model_validate(client.get(f"/v1/cost-models/{COST_MODEL}/revisions/1").json())
    assert math.isclose(file.activation.bytes_per_token_layer_none, 1.5 * act.bytes_per_token_layer_none,
                        rel_tol=1e-6)
    assert file.activation.fixed_working_bytes == act.fixed_working_bytes  # the fixed bytes stay
    cap = truth.cluster.memory_cap_bytes
    for step in range(2, 6):
        plan, _ = _plan(client, "p1", step)
        assert plan.cost_model_id == f"{COST_MODEL}@1"
        for group in plan.groups:
            if group.micro_batches:
                # the plan's own peak is the truth's, and under the cap
                assert math.isclose(group.predicted_peak_mem_bytes, group_peak_bytes(truth, group), rel_tol=1e-6)
                assert group.predicted_peak_mem_bytes <= cap


def test_oldest_measurements_are_folded_per_group_not_lost(tmp_path: Any) -> None:
    store = PlanStore.open(tmp_path / "s.sqlite")
    measurements = MeasurementStore(store, max_rows_per_epoch=8)
    rows = [RankMeasurement(step=s, rank=r, first_rank=r - r % 2, group_size=2, digest="d" * 64,
                            times_s=(1.0 + s + r % 2, 2.0), peak_bytes=r)
            for s in range(5) for r in range(4)]
    for s in range(5):
        measurements.add("e", rows[4 * s:4 * s + 4])
    assert measurements.num_rows("e") <= 8
    groups = measurements.groups("e")
    assert [(g.step, g.first_rank) for g in groups] == [(s, f) for s in range(5) for f in (0, 2)]
    for g in groups:  # the median over the group's two ranks, folded or not
        assert g.times_s == (1.5 + g.step, 2.0) and g.num_ranks == 2
    store.close()


def test_an_upload_may_not_take_a_revision_name(client: TestClient) -> None:
    file = client.get(f"/v1/cost-models/{COST_MODEL}").json()
    response = client.post("/v1/cost-models", json={**file, "id": "mine@3"}, headers=AUTH)
    assert response.status_code == 409 and "revisions" in response.json()["detail"]


def test_revisions_frozen_steps_and_measurements_survive_a_restart(settings: Any) -> None:
    from api.app import create_app

    with ReadingClient(create_app(settings)) as first:
        _epoch(first, "k1")
        views = [_view(first, "k1", s, r) for s in range(2) for r in range(8)]
        first.post("/v1/epochs/k1/recalibration", json={"follow": True, "every_steps": 2}, headers=AUTH)
        first.post("/v1/epochs/k1/measurements", json={"steps": [_measured(v, 2.0) for v in views]},
                   headers=AUTH)
        before = _recalibrated(first, "k1")
        digests = {s: _plan(first, "k1", s)[1] for s in range(6)}
    with ReadingClient(create_app(settings)) as second:
        after = second.get("/v1/epochs/k1/recalibration").json()
        assert after["revisions"] == before["revisions"] and after["frozen_through"] == 1
        assert after["current_ref"] == f"{COST_MODEL}@1" and after["measured_steps"] == 2
        assert {s: _plan(second, "k1", s)[1] for s in range(6)} == digests
        # Ranks go on: two more measured steps give the next revision, still never touching 0..3.
        more = [_measured(_view(second, "k1", s, r), 2.0) for s in (2, 3) for r in range(8)]
        assert second.post("/v1/epochs/k1/measurements", json={"steps": more},
                           headers=AUTH).json()["recalibration"] in ("scheduled", "running")
        _recalibrated(second, "k1", revisions=2)
        for s in range(4):
            assert _plan(second, "k1", s)[1] == digests[s]
        assert _plan(second, "k1", 4)[0].cost_model_id == f"{COST_MODEL}@2"
