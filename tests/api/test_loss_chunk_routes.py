"""``loss_chunk_tokens`` in plan and epoch requests: it sets the analytic cost model's LM loss
chunk (the id says which, the default keeps the plain id); a negative chunk, one longer than the
longest sample, one for a video model or beside ``cost_model_id`` is a 422 naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import AUTH, COST_MODEL, FAST

ROOT = Path(__file__).resolve().parents[2]
LLAMA31: dict[str, Any] = json.loads((ROOT / "examples/configs/llama-3.1-8b/config.json").read_text())
TEXT = [{"id": f"t{i}", "tokens": 1024 * (i % 8 + 1)} for i in range(16)]
VIDEO = [{"id": f"v{i}", "frames": 1 + i % 5, "height": 30, "width": 52} for i in range(4)]


def _plan(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/plans", json={"cluster": "h200x8", "options": FAST, "samples": TEXT, **body},
                       headers=AUTH)


def test_the_chunk_sets_the_cost_model(client: TestClient) -> None:
    ids = {}
    for chunk in (None, 4096, 1024, 0):
        body = {} if chunk is None else {"loss_chunk_tokens": chunk}
        response = _plan(client, model="llama-3.1-8b", **body)
        assert response.status_code == 200, response.text
        ids[chunk] = response.json()["plan"]["cost_model_id"]
    assert ids == {None: "analytic-llama-3.1-8b-h200-sxm", 4096: "analytic-llama-3.1-8b-h200-sxm",
                   1024: "analytic-llama-3.1-8b-h200-sxm-loss-chunk1024",
                   0: "analytic-llama-3.1-8b-h200-sxm-whole-logits"}
    stored = client.get(f"/v1/cost-models/{ids[1024]}").json()
    assert stored["model"]["loss_chunk_tokens"] == 1024
    assert stored["activation"]["loss_chunk_bytes"] == 1024 * 128256 * 6


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "llama-3.1-8b", "loss_chunk_tokens": -1}, "greater than or equal to 0"),
    ({"model_config": LLAMA31, "loss_chunk_tokens": 8193},
     "loss_chunk_tokens=8193 is larger than the longest sample (8192 tokens)"),
    ({"cost_model_id": COST_MODEL, "loss_chunk_tokens": 1024}, "loss_chunk_tokens=1024 applies to the analytic"),
    ({"model": "wan2.1-1.3b", "samples": VIDEO, "loss_chunk_tokens": 1024}, "a video model, no vocabulary"),
])
def test_a_bad_chunk_is_a_422_naming_it(client: TestClient, body: dict[str, Any], message: str) -> None:
    response = _plan(client, **body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert "loss_chunk_tokens" in detail["loc"] or "loss_chunk_tokens" in detail["msg"], detail
    assert message in detail["msg"], detail


def test_an_epoch_chunk_longer_than_the_manifest_is_a_422(client: TestClient) -> None:
    manifest = "".join(json.dumps(s) + "\n" for s in TEXT)
    response = client.post("/v1/epochs", json={"manifest_jsonl": manifest, "batch": {"samples_per_step": 8},
                                               "cluster": "h200x8", "options": FAST, "model": "llama-3.1-8b",
                                               "loss_chunk_tokens": 10000}, headers=AUTH)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "loss_chunk_tokens"]
    assert "larger than the manifest's longest sample (8192 tokens)" in detail["msg"]
