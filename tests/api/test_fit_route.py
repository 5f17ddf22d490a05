"""``POST /v1/cost-models/fit``: a profile fitted on the pool, registered, used to plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from costmodel.fit import fit_profiles
from costmodel.presets import load_model
from costmodel.profiling.format import Profile, parse_profile_lines, write_profile
from tests.costmodel.test_fit_synthetic import synthetic_profile

from .conftest import AUTH

pytestmark = pytest.mark.timeout(120)


def _profile_text(tmp_path: Path, *, noise: float, seed: int = 0) -> str:
    profile = synthetic_profile(load_model("llama-7b"), noise=noise, seed=seed)
    path = tmp_path / f"p{noise}.jsonl"
    write_profile(path, profile.header, [*profile.compute, *profile.head, *profile.comm])
    return path.read_text()


def read_profile_text(text: str) -> Profile:
    return parse_profile_lines(text.splitlines())


def test_fit_registers_and_refuses(client: TestClient, tmp_path: Path) -> None:
    text = _profile_text(tmp_path, noise=0.01)
    expected_digest = fit_profiles([read_profile_text(text)]).file.digest()
    body = {"profiles_jsonl": [text]}
    assert client.post("/v1/cost-models/fit", json=body).status_code == 401
    response = client.post("/v1/cost-models/fit", json=body, headers=AUTH)
    assert response.status_code == 201, response.text
    data = response.json()
    assert data["digest"] == expected_digest and data["created"] is True
    assert set(data["fit_quality"]) >= {"compute_time", "activation_bytes"}
    fitted = client.get(f"/v1/cost-models/{data['id']}").json()
    assert fitted["provenance"] == "fitted"
    again = client.post("/v1/cost-models/fit", json=body, headers=AUTH)
    assert again.status_code == 200 and again.json()["created"] is False

    noisy = _profile_text(tmp_path, noise=0.3, seed=1)
    refused = client.post("/v1/cost-models/fit", json={"profiles_jsonl": [noisy],
                                                       "options": {"model_id": "noisy"}}, headers=AUTH)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "profiles_jsonl"]
    assert "compute_time" in refused.text
    broken = client.post("/v1/cost-models/fit", json={"profiles_jsonl": [text.splitlines()[0] + "\n{x"]},
                         headers=AUTH)
    assert broken.status_code == 422 and "profiles_jsonl[0]:2" in broken.text
    assert "noisy" not in {m["id"] for m in client.get("/v1/cost-models").json()}
