"""Route-level tests through TestClient (real app, real store file, real process pool)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from api.store import PlanStore
from costmodel.presets import default_cost_model_file, load_cluster
from planner.plan import Plan, RankPlan

from .conftest import AUTH, COST_MODEL, FAST, ReadingClient, manifest_lines

pytestmark = pytest.mark.timeout(120)


def _epoch_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"manifest_jsonl": manifest_lines(24), "batch": {"samples_per_step": 12},
                            "seed": 3, "cluster": "h200x8", "cost_model_id": COST_MODEL,
                            "options": FAST}
    body.update(overrides)
    return body


def _wait_done(client: TestClient, epoch_id: str) -> dict[str, Any]:
    """The job's status once it ended (no deadline: the suite's timeout guards against a hang)."""
    while True:
        status = client.get(f"/v1/epochs/{epoch_id}").json()
        if status["state"] not in ("queued", "running"):
            return status
        time.sleep(0.1)


def test_health_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    spec = client.get("/openapi.json").json()
    for path in ("/v1/plans", "/v1/epochs", "/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}",
                 "/v1/cost-models"):
        assert path in spec["paths"]
    schemas = spec["components"]["schemas"]
    assert schemas["PlanRequest"]["examples"] and schemas["EpochRequest"]["examples"]


def test_presets_name_what_the_requests_accept(client: TestClient) -> None:
    presets = client.get("/v1/presets", headers=AUTH).json()
    assert set(presets) == {"models", "hardware", "clusters", "workloads", "cost-models"}
    assert COST_MODEL in {m["id"] for m in presets["cost-models"]}
    cluster = next(c for c in presets["clusters"] if c["name"] == "h200x8")
    cost_model = next(m for m in presets["cost-models"]
                      if m["model"] == "llama-7b" and m["hardware"] == cluster["hardware"]["name"])
    body = {"samples": [{"id": "a", "tokens": 4096}], "cluster": cluster["name"],
            "cost_model_id": cost_model["id"], "options": FAST}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    workload = presets["workloads"][0]
    assert {"name", "kind", "model"} <= set(workload)


def test_cost_models(client: TestClient) -> None:
    listed = client.get("/v1/cost-models").json()
    ids = {m["id"] for m in listed}
    assert COST_MODEL in ids and all(m["source"] == "builtin" for m in listed)
    assert client.get(f"/v1/cost-models/{COST_MODEL}").json()["id"] == COST_MODEL
    assert client.get("/v1/cost-models/nope").status_code == 404
    mine = default_cost_model_file("llama-7b", "h200-sxm").model_copy(
        update={"id": "fitted-7b", "provenance": "fitted"})
    body = mine.model_dump(mode="json")
    assert client.post("/v1/cost-models", json=body).status_code == 401  # token required
    created = client.post("/v1/cost-models", json=body, headers=AUTH)
    assert created.status_code == 201 and created.json()["created"] is True
    assert client.post("/v1/cost-models", json=body, headers=AUTH).status_code == 200
    other = {**body, "notes": "different"}
    assert client.post("/v1/cost-models", json=other, headers=AUTH).status_code == 409
    builtin = {**client.get(f"/v1/cost-models/{COST_MODEL}").json(), "notes": "x"}
    assert client.post("/v1/cost-models", json=builtin, headers=AUTH).status_code == 409
    bad = {**body, "id": "bad id!"}
    response = client.post("/v1/cost-models", json=bad, headers=AUTH)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "id"]
    assert {m["id"]: m["source"] for m in client.get("/v1/cost-models").json()}["fitted-7b"] == "uploaded"


def test_plan_one_batch(client: TestClient) -> None:
    lengths = [512, 4096, 32768, 1024, 65536, 2048, 8192, 16384, 700, 900]
    samples: list[dict[str, Any]] = [{"id": f"q{i}", "tokens": t} for i, t in enumerate(lengths)]
    body = {"samples": samples, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    data = response.json()
    plan = Plan.model_validate(data["plan"])
    assert plan.digest() == data["digest"]
    assert sorted(plan.sample_ids) == sorted(s["id"] for s in samples)
    assert data["gap"] == pytest.approx(plan.gap)
    assert plan.num_ranks == 8 and plan.cost_model_id == COST_MODEL
    again = client.post("/v1/plans", json=body, headers=AUTH).json()
    assert again["digest"] == data["digest"]  # deterministic for the same input and seed
    metrics = client.get("/metrics").text
    assert 'dcp_solver_duration_seconds_count{kind="sync"} 2.0' in metrics
    assert "dcp_http_request_duration_seconds_bucket" in metrics


@pytest.mark.parametrize(("body", "loc"), [
    ({"cluster": "h200x8", "cost_model_id": COST_MODEL}, ["body", "samples"]),
    ({"samples": [{"id": "a", "tokens": -5}], "cluster": "h200x8", "cost_model_id": COST_MODEL},
     ["body", "samples", 0, "tokens"]),
    ({"samples": [{"id": "a", "tokens": 5}], "cluster": "nope", "cost_model_id": COST_MODEL},
     ["body", "cluster"]),
    ({"samples": [{"id": "a", "tokens": 5}], "cluster": "h100x16", "cost_model_id": COST_MODEL},
     ["body", "cost_model_id"]),
    ({"samples": [{"id": "a", "tokens": 5}], "cluster": "h200x8", "cost_model_id": COST_MODEL,
      "options": {"warp_speed": 9}}, ["body", "options"]),
    ({"samples": [{"id": f"a{i}", "tokens": 5} for i in range(65)], "cluster": "h200x8",
      "cost_model_id": COST_MODEL}, ["body", "samples"]),
])
def test_plan_bad_input(client: TestClient, body: dict[str, Any], loc: list[Any]) -> None:
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][:len(loc)] == loc


def test_plan_duplicate_ids_and_unknown_model(client: TestClient) -> None:
    body = {"samples": [{"id": "a", "tokens": 5}, {"id": "a", "tokens": 6}], "cluster": "h200x8",
            "cost_model_id": COST_MODEL}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 422 and "duplicate sample id 'a'" in response.text
    body = {"samples": [{"id": "a", "tokens": 5}], "cluster": "h200x8", "cost_model_id": "nope"}
    assert client.post("/v1/plans", json=body, headers=AUTH).status_code == 404


def test_a_1d_sample_for_a_2d_model_is_named(client: TestClient) -> None:
    body = {"samples": [{"id": "clip", "tokens": 4096, "frames": 4, "height": 32, "width": 32},
                        {"id": "flat", "tokens": 4096}],
            "cluster": "h200x8", "cost_model_id": "analytic-stdit3-xl-h200-sxm", "options": FAST}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert "'flat'" in response.text and "2D" in response.text


def test_sample_that_fits_nowhere_is_named(client: TestClient) -> None:
    body = {"samples": [{"id": "ok", "tokens": 1024}, {"id": "giant", "tokens": 50_000_000}],
            "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert "giant" in response.text


def test_body_too_large(client: TestClient) -> None:
    body = {"samples": [{"id": "a" * 200, "tokens": 5}] * 6000, "cluster": "h200x8",
            "cost_model_id": COST_MODEL}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 413
    assert response.json()["detail"][0]["loc"] == ["body"]


def test_epoch_lifecycle(client: TestClient, settings: Settings) -> None:
    created = client.post("/v1/epochs", json=_epoch_body(epoch_id="e1"), headers=AUTH)
    assert created.status_code == 202, created.text
    assert created.json()["steps_total"] == 2
    status = _wait_done(client, "e1")
    assert status["state"] == "done", status
    assert status["steps_done"] == 2 and status["progress"] == 1.0 and status["eta_s"] == 0.0
    assert status["summary"]["mean_gap"] >= 0
    assert status["summary"]["mean_predicted_speedup_vs_bucket"] >= 1.0
    # The headline: against the strongest baseline (never above the weakest comparison).
    assert 1.0 - 1e-9 <= status["summary"]["mean_predicted_speedup_vs_strongest"] <= (
        status["summary"]["mean_predicted_speedup_vs_bucket"])
    seen: list[str] = []
    for step in range(2):
        data = client.get(f"/v1/epochs/e1/steps/{step}").json()
        plan = Plan.model_validate(data["plan"])
        assert plan.step == step and plan.digest() == data["digest"]
        seen += plan.sample_ids
        for rank in range(plan.num_ranks):
            view = RankPlan.model_validate(client.get(f"/v1/epochs/e1/steps/{step}/ranks/{rank}").json())
            assert view.plan_digest == data["digest"] and view == plan.rank_view(rank)
        assert client.get(f"/v1/epochs/e1/steps/{step}/ranks/8").status_code == 404
    assert sorted(seen) == sorted(f"s{i}" for i in range(24))  # every sample once, none moved out
    ranged = client.get("/v1/epochs/e1/steps", params={"start": 0, "stop": 5}).json()
    assert [r["step"] for r in ranged] == [0, 1]
    missing = client.get("/v1/epochs/e1/steps/2")
    assert missing.status_code == 404 and "has 2 steps" in missing.json()["detail"]
    assert "retry-after" not in missing.headers  # final: clients must not wait for it
    assert client.get("/v1/epochs/nope/steps/0").status_code == 404
    assert client.get("/v1/epochs/nope").status_code == 404
    assert [e["epoch_id"] for e in client.get("/v1/epochs").json()] == ["e1"]
    assert client.post("/v1/epochs", json=_epoch_body(epoch_id="e1"), headers=AUTH).status_code == 409
    assert client.post("/v1/epochs/e1/cancel", headers=AUTH).json()["state"] == "done"
    metrics = client.get("/metrics").text
    assert 'dcp_epoch_progress{epoch_id="e1"} 1.0' in metrics
    assert "dcp_plans_stored 2.0" in metrics
    assert 'route="/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}",status="200"' in metrics
    assert 'route="/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}",status="404"' in metrics


def test_epoch_tokens_rule_and_manifest_path(client: TestClient, settings: Settings) -> None:
    (settings.data_dir / "m.jsonl").write_text(manifest_lines(20))
    body = _epoch_body(epoch_id="tok", manifest_jsonl=None, manifest_path="m.jsonl",
                       batch={"tokens_per_step": 131072})
    created = client.post("/v1/epochs", json=body, headers=AUTH)
    assert created.status_code == 202, created.text
    status = _wait_done(client, "tok")
    assert status["state"] == "done", status
    plans = client.get("/v1/epochs/tok/steps", params={"start": 0, "stop": status["steps_total"]}).json()
    for entry in plans:
        assert sum(ps["sample"]["tokens"] for g in entry["plan"]["groups"] for mb in g["micro_batches"]
                   for ps in mb["samples"]) <= 131072


def test_epoch_bad_inputs_leave_store_intact(client: TestClient, settings: Settings,
                                            tmp_path: Path) -> None:
    (tmp_path / "secret.jsonl").write_text(manifest_lines(4))
    cases: list[tuple[dict[str, Any], int]] = [
        (_epoch_body(manifest_jsonl=None, manifest_path="../secret.jsonl"), 400),
        (_epoch_body(manifest_jsonl=None, manifest_path=str(tmp_path / "secret.jsonl")), 400),
        (_epoch_body(manifest_jsonl=None, manifest_path="absent.jsonl"), 422),
        (_epoch_body(manifest_jsonl='{"id": "a", "tokens": 5}\nnot json\n'), 422),
        (_epoch_body(batch={"samples_per_step": 4, "tokens_per_step": 9}), 422),
        (_epoch_body(batch={"samples_per_step": 0}), 422),
        (_epoch_body(epoch_id="bad/id"), 422),
        (_epoch_body(cost_model_id="nope"), 404),
        (_epoch_body(options={"nope": 1}), 422),
        (_epoch_body(batch={"tokens_per_step": 100}), 422),
    ]
    for body, code in cases:
        response = client.post("/v1/epochs", json=body, headers=AUTH)
        assert response.status_code == code, (body, response.text)
    (settings.data_dir / "link.jsonl").symlink_to(tmp_path / "secret.jsonl")
    assert client.post("/v1/epochs", json=_epoch_body(manifest_jsonl=None, manifest_path="link.jsonl"),
                       headers=AUTH).status_code == 400
    assert client.post("/v1/epochs", json=_epoch_body()).status_code == 401
    bad_token = {"Authorization": "Bearer wrong"}
    assert client.post("/v1/epochs", json=_epoch_body(), headers=bad_token).status_code == 401
    assert client.post("/v1/epochs/x/cancel").status_code == 401
    assert client.get("/v1/epochs").json() == []
    store = PlanStore.open(settings.db_path)
    assert store.list_epochs() == [] and store.num_plans() == 0
    store.close()


def test_cancel(client: TestClient) -> None:
    # A cancel that arrives after its job finished cancels nothing (the job stays done), and on a
    # loaded machine 50 small steps can finish between the two requests: each round gives the
    # next job 4x the steps, until a cancel finds its job running. Judged by that outcome, no clock.
    steps = 50
    for attempt in range(4):
        epoch_id = f"c{attempt}"
        body = _epoch_body(epoch_id=epoch_id, manifest_jsonl=manifest_lines(8 * steps), batch={"samples_per_step": 8})
        assert client.post("/v1/epochs", json=body, headers=AUTH).status_code == 202
        status = client.post(f"/v1/epochs/{epoch_id}/cancel", headers=AUTH).json()
        if status["state"] != "done":
            break
        assert status["steps_done"] == steps  # done means every step, cancel or not
        steps *= 4
    assert status["state"] == "cancelled" and status["steps_done"] < steps, status
    time.sleep(0.3)  # the cancel joined the job's thread: nothing may be stored after it
    later = client.get(f"/v1/epochs/{epoch_id}").json()
    assert later["state"] == "cancelled" and later["steps_done"] == status["steps_done"]
    unplanned = client.get(f"/v1/epochs/{epoch_id}/steps/{steps - 1}/ranks/0")
    assert unplanned.status_code == 404 and "not planned yet" in unplanned.json()["detail"]
    assert "retry-after" not in unplanned.headers  # a cancelled job will not plan it


def test_step_still_being_planned_says_retry_after(client: TestClient) -> None:
    body = _epoch_body(epoch_id="r1", manifest_jsonl=manifest_lines(800), batch={"samples_per_step": 8})
    assert client.post("/v1/epochs", json=body, headers=AUTH).status_code == 202
    pending = client.get("/v1/epochs/r1/steps/99/ranks/0")
    assert client.get("/v1/epochs/r1").json()["state"] in ("queued", "running")
    assert pending.status_code == 404 and pending.headers["retry-after"] == "1", pending.text
    client.post("/v1/epochs/r1/cancel", headers=AUTH)


def test_cors_off_by_default_and_on_when_configured(client: TestClient, settings: Settings) -> None:
    origin = {"Origin": "http://dashboard.example"}
    assert "access-control-allow-origin" not in client.get("/healthz", headers=origin).headers
    # Another store file: the running client's app holds the writer lease of the first one.
    cors = settings.model_copy(update={"cors_origins": ["http://dashboard.example"],
                                       "db_path": settings.db_path.with_name("cors.sqlite")})
    with ReadingClient(create_app(cors)) as cors_client:
        response = cors_client.get("/healthz", headers=origin)
        assert response.headers["access-control-allow-origin"] == "http://dashboard.example"


def test_epoch_with_a_sample_that_fits_nowhere_is_refused_naming_it(client: TestClient) -> None:
    manifest = manifest_lines(11) + '{"id": "giant", "tokens": 50000000}\n'
    body = _epoch_body(epoch_id="bad", manifest_jsonl=manifest, batch={"samples_per_step": 4})
    response = client.post("/v1/epochs", json=body, headers=AUTH)  # checked before the job is stored
    assert response.status_code == 422 and "giant" in response.text, response.text[:300]
    assert client.get("/v1/epochs/bad").status_code == 404


def test_pool_recovers_after_a_worker_is_killed(client: TestClient) -> None:
    body = {"samples": [{"id": "a", "tokens": 4096}, {"id": "b", "tokens": 1024}], "cluster": "h200x8",
            "cost_model_id": COST_MODEL, "options": FAST}
    assert client.post("/v1/plans", json=body, headers=AUTH).status_code == 200
    pool = client.app.state.service.executor  # type: ignore[attr-defined]
    pids = pool.worker_pids()
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    codes = []
    for _ in range(3):  # the request in flight when the pool broke may get a 503, then it recovers
        codes.append(client.post("/v1/plans", json=body, headers=AUTH).status_code)
        if codes[-1] == 200:
            break
    assert codes[-1] == 200 and set(codes) <= {200, 503}, codes
    assert pool.worker_pids() and not set(pool.worker_pids()) & set(pids)


def test_plan_refuses_a_cost_model_of_other_hardware_or_sharding_the_executor_does_not_run(
        client: TestClient) -> None:
    samples = [{"id": f"q{i}", "tokens": 1024 * (i + 1)} for i in range(4)]
    body = {"samples": samples, "cluster": "h100x16", "cost_model_id": COST_MODEL, "options": FAST}
    response = client.post("/v1/plans", json=body, headers=AUTH)
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "cost_model_id"]
    assert "runs 'h100-sxm'" in detail["msg"] and "dcp fit --hardware h100-sxm" in detail["msg"]
    cluster = load_cluster("h200x8").model_dump(mode="json") | {"state_sharding": "zero2"}
    response = client.post("/v1/plans", json={**body, "cluster": cluster}, headers=AUTH)
    assert response.status_code == 422
    assert "state_sharding='zero2' is not what the executor runs" in response.json()["detail"][0]["msg"]


def test_a_finished_epoch_reports_its_run_rate(client: TestClient) -> None:
    """``steps_per_s`` of an ended job is the rate of its run (it was null once the job was done)."""
    body = _epoch_body(epoch_id="rate", manifest_jsonl=manifest_lines(40), batch={"samples_per_step": 8})
    assert client.post("/v1/epochs", json=body, headers=AUTH).status_code == 202
    status = _wait_done(client, "rate")
    assert status["state"] == "done" and status["steps_done"] == 5
    assert status["steps_per_s"] is not None and status["steps_per_s"] > 0, status
    assert status["started_at"] is not None and status["finished_at"] is not None
    elapsed_s = status["finished_at"] - status["started_at"]
    assert status["steps_per_s"] == pytest.approx(5 / elapsed_s)
