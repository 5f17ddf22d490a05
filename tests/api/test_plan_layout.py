"""The plan request's ``options.layout`` (issue 25): ``auto`` plans a sample no Ulysses group holds
on a Ulysses x ring group past the heads, valid under the service's validator; an unknown layout is
a 422 naming the field."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.api.conftest import AUTH, FAST

# 4M tokens need 76.5 GiB per rank on 32 ranks of Llama-3.1-8B even fully checkpointed (65.5 GiB
# left; 2M fit in 38.3 GiB with the LM loss in chunks): no Ulysses group (at most the 32 query
# heads) holds the sample on an H200
LONG = [{"id": "huge", "tokens": 4 * 1024 * 1024}, *({"id": f"t{i}", "tokens": 4096 * (i + 1)} for i in range(7))]


def _plan(client: TestClient, options: dict[str, Any]) -> Any:
    return client.post("/v1/plans", json={"cluster": "h200x64", "model": "llama-3.1-8b", "samples": LONG,
                                          "options": {**FAST, **options}}, headers=AUTH)


def test_auto_layout_plans_past_the_heads(client: TestClient) -> None:
    response = _plan(client, {"layout": "auto"})
    assert response.status_code == 200, response.text
    groups = response.json()["plan"]["groups"]
    assert [(len(g["ranks"]), g.get("ring_degree", 1)) for g in groups] == [(64, groups[0]["ring_degree"])]
    assert groups[0]["ring_degree"] > 1
    # a request naming no layout gets the service's default, auto: the same plan
    default = _plan(client, {})
    assert default.status_code == 200 and default.json()["plan"]["groups"] == groups, default.text
    # pure Ulysses cannot hold the sample: the error names it
    refused = _plan(client, {"layout": "ulysses"})
    assert refused.status_code == 422 and "huge" in refused.text and "fits nowhere" in refused.text, refused.text


def test_unknown_layout_is_a_422_naming_the_field(client: TestClient) -> None:
    response = _plan(client, {"layout": "spiral"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"][-1] == "layout" and "options" in detail["loc"], detail
