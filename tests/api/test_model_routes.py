"""``model`` and ``model_config`` beside ``cost_model_id`` in plan and epoch requests: exactly one,
a bad config is a 422 naming the field, samples of the other kind are a 422 naming the sample, and
an epoch's model is registered so that the restarted service resolves the job's cost model."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from api.store import PlanStore
from tests.api.conftest import AUTH, COST_MODEL, FAST, ReadingClient, manifest_lines

ROOT = Path(__file__).resolve().parents[2]
LLAMA31: dict[str, Any] = json.loads((ROOT / "examples/configs/llama-3.1-8b/config.json").read_text())
TEXT = [{"id": f"t{i}", "tokens": 1024 * (i % 8 + 1)} for i in range(16)]
VIDEO = [{"id": f"v{i}", "frames": 1 + i % 5, "height": 30, "width": 52} for i in range(16)]


def _plan(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/plans", json={"cluster": "h200x64", "options": FAST, **body}, headers=AUTH)


def test_plan_under_a_model_config_or_a_preset(client: TestClient) -> None:
    # Named by its _name_or_path (else by family, layers and hidden size).
    response = _plan(client, samples=TEXT, model_config={**LLAMA31, "_name_or_path": "meta-llama/llama-3.1-8b"})
    assert response.status_code == 200, response.text
    assert response.json()["plan"]["cost_model_id"] == "analytic-llama-3.1-8b-h200-sxm"
    response = _plan(client, samples=TEXT, model_config=LLAMA31)
    assert response.status_code == 200, response.text
    assert response.json()["plan"]["cost_model_id"] == "analytic-llama-32l-4096-h200-sxm"
    assert client.get("/v1/cost-models/analytic-llama-32l-4096-h200-sxm").status_code == 200  # registered
    response = _plan(client, samples=VIDEO, model="wan2.1-1.3b")
    assert response.status_code == 200, response.text
    assert response.json()["plan"]["cost_model_id"] == "analytic-wan2.1-1.3b-h200-sxm"


@pytest.mark.parametrize(("body", "loc", "message"), [
    ({"model_config": {**LLAMA31, "num_key_value_heads": 5}}, ["body", "model_config"],
     "model_config: num_attention_heads=32 is not divisible by num_key_value_heads=5"),
    ({"model_config": {**LLAMA31, "model_type": "gpt2"}}, ["body", "model_config"],
     "unknown architecture model_type='gpt2'; known: llama"),
    ({"model_config": {k: v for k, v in LLAMA31.items() if k != "vocab_size"}}, ["body", "model_config"],
     "missing field 'vocab_size'"),
    ({"model": "llama-9b"}, ["body", "model"], "model: unknown model preset 'llama-9b'"),
    ({"model": "llama-3.1-8b", "cost_model_id": COST_MODEL}, ["body"],
     "give exactly one of cost_model_id, model and model_config, not cost_model_id and model"),
    ({}, ["body"], "give exactly one of cost_model_id, model and model_config"),
    ({"model_config": LLAMA31, "samples": [*TEXT[:3], VIDEO[0]]}, ["body", "samples"],
     "sample 'v0' (#3) is a video sample (1x30x52"),
    ({"model": "wan2.1-14b", "samples": TEXT}, ["body", "samples"], "sample 't0' (#0) is a text sample"),
])
def test_plan_bad_model_is_a_422_naming_the_field(client: TestClient, body: dict[str, Any], loc: list[Any],
                                                  message: str) -> None:
    response = _plan(client, **{"samples": TEXT, **body})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"][:len(loc)] == loc, detail
    assert message in detail["msg"], detail


def _wait(client: TestClient, epoch_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status: dict[str, Any] = client.get(f"/v1/epochs/{epoch_id}").json()
        if status["state"] not in ("queued", "running"):
            return status
        time.sleep(0.1)
    raise AssertionError(f"epoch {epoch_id} not finished")


def test_epoch_under_a_model_config_survives_a_restart(settings: Settings) -> None:
    renamed = {**LLAMA31, "vocab_size": 32000, "_name_or_path": "meta-llama/llama-3.1-8b"}  # not the preset
    body = {"manifest_jsonl": manifest_lines(24), "batch": {"samples_per_step": 12}, "cluster": "h200x8",
            "options": FAST}
    with ReadingClient(create_app(settings)) as client:
        video = "".join(json.dumps(v) + "\n" for v in VIDEO)
        refused = client.post("/v1/epochs", json={**body, "epoch_id": "bad", "manifest_jsonl": video,
                                                  "model_config": LLAMA31}, headers=AUTH)
        assert refused.status_code == 422, refused.text
        detail = refused.json()["detail"][0]
        assert detail["loc"] == ["body", "manifest_jsonl"] and "sample 'v0' (#0) is a video sample" in detail["msg"]
        created = client.post("/v1/epochs", json={**body, "epoch_id": "cfg", "model_config": renamed}, headers=AUTH)
        assert created.status_code == 202, created.text
        status = _wait(client, "cfg")
        assert status["state"] == "done", status
        cost_model_id = status["cost_model_id"]
        assert cost_model_id.startswith("analytic-llama-3.1-8b-h200-sxm-")  # the preset's id is taken
    store = PlanStore.open(settings.db_path)
    record = store.get_epoch("cfg")
    assert [r.id for r in store.list_epochs()] == ["cfg"]
    store.close()
    assert record is not None
    assert record.spec["model"] == {"name": "llama-3.1-8b", "kind": "1d", "source": "model_config (llama-3.1-8b)"}
    with ReadingClient(create_app(settings)) as client:  # a restarted service resolves the job's model
        found = client.get(f"/v1/cost-models/{cost_model_id}")
        assert found.status_code == 200, found.text
        assert found.json()["model"]["vocab"] == 32000
        assert client.post("/v1/epochs/cfg/resume", headers=AUTH).json()["state"] == "done"
        plan = client.get("/v1/epochs/cfg/steps/0").json()["plan"]
        assert plan["cost_model_id"] == cost_model_id
