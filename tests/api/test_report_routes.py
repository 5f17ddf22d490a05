"""The report routes and the dashboard through TestClient: pictures of a real stored epoch, the
OpenAPI document's content types, 404 with a reason and 422 for bad parameters."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from api.settings import Settings
from planner.plan import Plan

from .conftest import AUTH, COST_MODEL, FAST, TOKEN, ReadingClient, manifest_lines

pytestmark = pytest.mark.timeout(180)

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """One service for the module, with one epoch ``rep`` of 2 steps planned."""
    tmp: Path = tmp_path_factory.mktemp("report")
    (tmp / "data").mkdir()
    settings = Settings(db_path=tmp / "plans.sqlite", data_dir=tmp / "data", num_workers=1, auth_token=TOKEN)
    with ReadingClient(create_app(settings)) as c:
        _epoch(c, "rep")
        yield c


def _epoch(client: TestClient, epoch_id: str) -> dict[str, Any]:
    body = {"epoch_id": epoch_id, "manifest_jsonl": manifest_lines(24), "batch": {"samples_per_step": 12},
            "seed": 1, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    assert client.post("/v1/epochs", json=body, headers=AUTH).status_code == 202
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status = client.get(f"/v1/epochs/{epoch_id}").json()
        if status["state"] not in ("queued", "running"):
            assert status["state"] == "done", status
            return status
        time.sleep(0.1)
    raise AssertionError("epoch not done")


def test_pictures_of_a_stored_epoch(client: TestClient) -> None:
    plan = Plan.model_validate(client.get("/v1/epochs/rep/steps/1").json()["plan"])
    svg = client.get("/v1/epochs/rep/steps/1/gantt.svg")
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(svg.content)
    bars = [g for g in root.iter(f"{SVG}g") if g.get("id") == "dcp-microbatches"]
    assert len(bars) == 1 and len(list(bars[0].iter(f"{SVG}path"))) == sum(
        len(g.micro_batches) for g in plan.groups)
    assert any(g.get("id") == "baseline-microbatches" for g in root.iter(f"{SVG}g"))
    alone = ET.fromstring(client.get("/v1/epochs/rep/steps/1/gantt.svg?baseline=false").content)
    assert not any(g.get("id") == "baseline-microbatches" for g in alone.iter(f"{SVG}g"))
    png = client.get("/v1/epochs/rep/steps/0/gantt.png")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    Image.open(io.BytesIO(png.content)).verify()
    chart = client.get("/v1/epochs/rep/report.svg")
    assert chart.status_code == 200
    assert sum(1 for g in ET.fromstring(chart.content).iter(f"{SVG}g")
               if (g.get("id") or "").startswith("gap-step")) == 2
    assert client.get("/v1/epochs/rep/report.png").content.startswith(b"\x89PNG")
    figures = client.get("/v1/epochs/rep/figures").json()
    assert [f["step"] for f in figures] == [0, 1]
    assert figures[1]["predicted_step_time_s"] == plan.predicted_step_time_s
    assert figures[1]["gap"] == pytest.approx(plan.gap)
    assert figures[1]["speedups"]["strongest"] >= 1.0 - 1e-9
    page = client.get("/v1/epochs/rep/report.html?step=1")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://", page.text) and "Step 1: the plan beside" in page.text
    assert page.text.count('src="data:image/svg+xml;base64,') == 2


def test_unknown_ids_answer_404_with_a_reason_and_bad_params_422(client: TestClient) -> None:
    for url in ("/v1/epochs/nope/report.svg", "/v1/epochs/nope/report.html", "/v1/epochs/nope/figures",
                "/v1/epochs/nope/steps/0/gantt.png"):
        response = client.get(url)
        assert response.status_code == 404 and "unknown epoch 'nope'" in response.json()["detail"], url
    response = client.get("/v1/epochs/rep/steps/7/gantt.svg")
    assert response.status_code == 404 and "has 2 steps; step 7 does not exist" in response.json()["detail"]
    assert client.get("/v1/epochs/rep/report.html?step=9").status_code == 404
    for url, loc in (("/v1/epochs/rep/steps/0/gantt.svg?baseline=maybe", ["query", "baseline"]),
                     ("/v1/epochs/rep/report.html?step=-1", ["query", "step"]),
                     ("/v1/epochs/rep/steps/x/gantt.svg", ["path", "step"]),
                     ("/v1/epochs/bad%20id/report.svg", ["path", "epoch_id"])):
        response = client.get(url)
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == loc, url


def test_openapi_declares_the_pictures_content_types(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    expected = {"/v1/epochs/{epoch_id}/steps/{step}/gantt.svg": "image/svg+xml",
                "/v1/epochs/{epoch_id}/steps/{step}/gantt.png": "image/png",
                "/v1/epochs/{epoch_id}/report.svg": "image/svg+xml",
                "/v1/epochs/{epoch_id}/report.png": "image/png",
                "/v1/epochs/{epoch_id}/report.html": "text/html",
                "/v1/epochs/{epoch_id}/figures": "application/json",
                "/dashboard": "text/html", "/dashboard/dashboard.js": "text/javascript",
                "/dashboard/dashboard.css": "text/css"}
    for path, media_type in expected.items():
        ok = paths[path]["get"]["responses"]["200"]["content"]
        assert list(ok) == [media_type], (path, ok)
        assert "404" in paths[path]["get"]["responses"] or path.startswith("/dashboard")


def test_dashboard_page_and_assets_are_served_locally(client: TestClient) -> None:
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert "/dashboard/dashboard.js" in refs and "/dashboard/dashboard.css" in refs
    for ref in refs:
        assert not re.match(r"(?i)https?:|//", ref), ref
        if ref.startswith("/dashboard/"):
            assert client.get(ref).status_code == 200
    script = client.get("/dashboard/dashboard.js").text
    assert not re.search(r"https?://", script)
    assert "/v1/epochs" in script and "gantt.svg" in script and "report.svg" in script


def test_the_service_imports_matplotlib_only_to_draw() -> None:
    code = "import sys, api.app; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_measured_steps_add_their_prediction_error(client: TestClient) -> None:
    """Last in the module: it adds measurements to ``rep`` (ranks that ran 25% slower than predicted)."""
    from api.measurements_store import MeasurementStore, RankMeasurement

    store = client.app.state.service.store  # type: ignore[attr-defined]
    rows = []
    for step in (0, 1):
        digest, text = store.get_plan("rep", step)
        for group in Plan.model_validate_json(text).groups:
            rows += [RankMeasurement(step=step, rank=r, first_rank=group.first_rank, group_size=group.size,
                                     digest=digest, peak_bytes=None,
                                     times_s=tuple(1.25 * mb.predicted_time_s for mb in group.micro_batches))
                     for r in group.ranks]
    assert MeasurementStore(store).add("rep", rows)[0] == len(rows)
    root = ET.fromstring(client.get("/v1/epochs/rep/report.svg").content)
    ids = {g.get("id") for g in root.iter(f"{SVG}g")}
    assert {"error-step0", "error-step1", "error-bias"} <= ids
    page = client.get("/v1/epochs/rep/report.html").text
    assert "2 measured steps" in page and "MAPE 20.0%, mean predicted / measured 0.800" in page


@pytest.fixture(scope="module")
def fresh_epoch(client: TestClient) -> str:
    """An epoch no other test posts measurements to."""
    _epoch(client, "fresh")
    return "fresh"


def test_step_trace_has_a_track_per_rank_and_the_measured_step(client: TestClient, fresh_epoch: str) -> None:
    epoch = fresh_epoch
    plan = Plan.model_validate(client.get(f"/v1/epochs/{epoch}/steps/0", headers=AUTH).json()["plan"])
    response = client.get(f"/v1/epochs/{epoch}/steps/0/trace.json", headers=AUTH)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    events = response.json()["traceEvents"]
    tracks = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == set(range(plan.num_ranks))
    assert sum(1 for e in events if e.get("cat") == "micro_batch") == sum(
        g.size * len(g.micro_batches) for g in plan.groups)
    assert not any(e["pid"] == 2 for e in events)  # nothing measured yet
    group = plan.groups[0]
    view = client.get(f"/v1/epochs/{epoch}/steps/0/ranks/{group.first_rank}", headers=AUTH).json()
    times = [2 * mb.predicted_time_s for mb in group.micro_batches]
    posted = client.post(f"/v1/epochs/{epoch}/measurements", headers=AUTH, json={"steps": [
        {"step": 0, "rank": group.first_rank, "plan_digest": view["plan_digest"],
         "micro_batch_times_s": times, "peak_bytes": None}]})
    assert posted.status_code == 200, posted.text
    events = client.get(f"/v1/epochs/{epoch}/steps/0/trace.json", headers=AUTH).json()["traceEvents"]
    measured = [e for e in events if e["pid"] == 2 and e["ph"] == "X"]
    assert len(measured) == group.size * len(times)
    assert sorted({round(e["dur"] / 1e6, 9) for e in measured}) == sorted({round(t, 9) for t in times})
    # The figures the dashboard lists: planner wall time, tokens, and the measured step's error.
    figures = {f["step"]: f for f in client.get(f"/v1/epochs/{epoch}/figures", headers=AUTH).json()}
    tokens = sum(ps.sample.tokens for g in plan.groups for mb in g.micro_batches for ps in mb.samples)
    assert figures[0]["num_tokens"] == tokens
    assert figures[0]["predicted_tokens_per_s"] == pytest.approx(tokens / plan.predicted_step_time_s)
    assert plan.solver.wall_time_s == 0.0  # stored plans keep 0 there (equal inputs, equal bytes) ...
    assert 0 < figures[0]["planning_wall_s"] < 60  # ... and the store keeps the planner's wall time beside
    assert figures[0]["measured"]["num_micro_batches"] == len(times)
    assert figures[0]["measured"]["mean_ratio"] == pytest.approx(0.5)  # measured at twice the prediction
    assert client.get(f"/v1/epochs/{epoch}/steps/99/trace.json", headers=AUTH).status_code == 404


def test_step_memory_chart_shows_the_measured_peak(client: TestClient, fresh_epoch: str) -> None:
    epoch = fresh_epoch
    plan = Plan.model_validate(client.get(f"/v1/epochs/{epoch}/steps/1", headers=AUTH).json()["plan"])
    svg = client.get(f"/v1/epochs/{epoch}/steps/1/memory.svg", headers=AUTH)
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    ids = {g.get("id") for g in ET.fromstring(svg.content).iter(f"{SVG}g")}
    working = [g for g in plan.groups if g.micro_batches]
    assert {f"memory-activations-{x}" for x in range(len(working))} <= ids
    assert b"measured peak" not in svg.content
    group = working[-1]
    view = client.get(f"/v1/epochs/{epoch}/steps/1/ranks/{group.first_rank}", headers=AUTH).json()
    posted = client.post(f"/v1/epochs/{epoch}/measurements", headers=AUTH, json={"steps": [
        {"step": 1, "rank": group.first_rank, "plan_digest": view["plan_digest"],
         "micro_batch_times_s": [mb.predicted_time_s for mb in group.micro_batches], "peak_bytes": 40 * 2**30}]})
    assert posted.status_code == 200, posted.text
    again = client.get(f"/v1/epochs/{epoch}/steps/1/memory.svg", headers=AUTH)
    assert b"measured peak" in again.content
    assert client.get(f"/v1/epochs/{epoch}/steps/1/memory.png", headers=AUTH).content.startswith(b"\x89PNG")
