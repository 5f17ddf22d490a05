"""Regression of the reliability round (issue 24 item 6): with a token set every route but health,
metrics and the dashboard's static page needs one, ``/docs`` included (it was open: plans, sample
ids, uploaded cost models, reports, the OpenAPI document); a read token reads and never writes."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest

from .conftest import AUTH, COST_MODEL, TOKEN, manifest_lines
from .test_server import _epoch, _wait

pytestmark = pytest.mark.timeout(180)

READ_TOKEN = "read-only-token"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
READS = ["/v1/epochs", "/v1/epochs/e", "/v1/epochs/e/steps?start=0&stop=2", "/v1/epochs/e/steps/1",
         "/v1/epochs/e/steps/1/ranks/0", "/v1/epochs/e/steps/1/ranks/3", "/v1/epochs/e/recalibration",
         "/v1/epochs/e/figures", "/v1/epochs/e/report.html", "/v1/epochs/e/steps/1/trace.json",
         "/v1/cost-models", f"/v1/cost-models/{COST_MODEL}", "/v1/presets", "/docs", "/redoc",
         "/openapi.json", "/metrics"]
PUBLIC = ["/healthz", "/readyz", "/dashboard", "/dashboard/dashboard.js"]


def _basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"anyone:{password}".encode()).decode()}


def test_every_read_needs_a_token_and_the_read_token_cannot_write(server_factory: Any) -> None:
    server = server_factory(env={"DCP_READ_TOKEN": READ_TOKEN}).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(8), 2)).status_code == 202
    assert _wait(server, "e")["state"] == "done"
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        for path in READS:
            anonymous = http.get(path)
            assert anonymous.status_code == 401, (path, anonymous.status_code)
            assert COST_MODEL not in anonymous.text and "s0" not in anonymous.text
            assert http.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            assert http.get(path, headers=READ).status_code == 200, path
            assert http.get(path, headers=AUTH).status_code == 200, path
        for path in PUBLIC:
            assert http.get(path).status_code == 200, path
        # /metrics names the epochs: only with a token (anonymous: 401 above, nothing listed).
        assert 'epoch_id="e"' in http.get("/metrics", headers=READ).text
        # A browser opening /docs is asked for Basic credentials; the token as the password works.
        assert http.get("/docs").headers["www-authenticate"].startswith("Basic")
        assert http.get("/docs", headers=_basic(READ_TOKEN)).status_code == 200
        assert http.get("/openapi.json", headers=_basic(TOKEN)).status_code == 200
        assert http.get("/openapi.json", headers=_basic("nope")).status_code == 401
        # The read token never writes; the write token does.
        cancel = http.post("/v1/epochs/e/cancel", headers=READ)
        assert cancel.status_code == 403 and "read token" in cancel.text
        assert http.delete(f"/v1/cost-models/{COST_MODEL}", headers=READ).status_code == 403
        body = {"samples": [{"id": "a", "tokens": 4096}], "cluster": "h200x8", "cost_model_id": COST_MODEL,
                "options": {"time_limit_s": 5.0, "use_cpsat": False}}
        assert http.post("/v1/plans", json=body, headers=READ).status_code == 403
        assert http.post("/v1/plans", json=body).status_code == 401
        assert http.post("/v1/plans", json=body, headers=AUTH).status_code == 200


def test_without_a_token_reads_are_open(server_factory: Any) -> None:
    server = server_factory(token=None).start()
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        for path in ("/v1/epochs", "/v1/cost-models", "/docs", "/openapi.json"):
            assert http.get(path).status_code == 200, path
