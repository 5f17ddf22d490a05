"""``POST /v1/epochs`` checks what the CLI checks, before the job is stored: a sample that fits
nowhere and a number given as a string are 422 naming the sample, not 202 and a failed job."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import AUTH, COST_MODEL, FAST

pytestmark = pytest.mark.timeout(120)


def _post(client: TestClient, manifest: str) -> tuple[int, str]:
    body = {"manifest_jsonl": manifest, "batch": {"samples_per_step": 2}, "cluster": "h200x8",
            "cost_model_id": COST_MODEL, "options": FAST}
    response = client.post("/v1/epochs", json=body, headers=AUTH)
    return response.status_code, response.text


def test_a_sample_that_fits_nowhere_is_422_before_the_job_is_stored(client: TestClient) -> None:
    code, text = _post(client, '{"id": "ok", "tokens": 4096}\n{"id": "monster", "tokens": 40000000}\n')
    assert code == 422, text
    assert "sample 'monster' (40,000,000 tokens) fits nowhere" in text and " GiB" in text, text
    assert client.get("/v1/epochs").json() == []


def test_a_string_number_is_422_as_in_the_cli(client: TestClient) -> None:
    code, text = _post(client, '{"id": "a", "tokens": "12"}\n{"id": "b", "tokens": 12}\n')
    assert code == 422 and "manifest_jsonl:1: tokens" in text, text
    assert client.get("/v1/epochs").json() == []
    code, text = _post(client, '{"id": "a", "tokens": 12}\n{"id": "b", "tokens": 12}\n')
    assert code == 202, text
