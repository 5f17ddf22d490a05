"""One-off plans: measurements in, a revision fitted from them, plans made with id@rev."""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi.testclient import TestClient

from planner.plan import Plan

from .conftest import AUTH, COST_MODEL, FAST, bytes_truth, group_peak_bytes


def _plan(client: TestClient, seed: int, model: str = COST_MODEL) -> dict[str, Any]:
    samples = [{"id": f"p{seed}-{i}", "tokens": 1024 * (1 + (i * 5 + seed) % 16)} for i in range(12)]
    response = client.post("/v1/plans", json={"samples": samples, "cluster": "h200x8", "cost_model_id": model,
                                              "options": FAST}, headers=AUTH)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _ranks(plan: dict[str, Any], digest: str, factor: float) -> list[dict[str, Any]]:
    return [{"rank": r, "plan_digest": digest,
             "micro_batch_times_s": [factor * mb["predicted_time_s"] for mb in g["micro_batches"]]}
            for g in plan["groups"] for r in g["ranks"]]


def test_one_off_plan_measurements_give_a_revision_that_plans(client: TestClient) -> None:
    path = "/v1/plans/measurements"
    assert client.post(f"/v1/cost-models/{COST_MODEL}/recalibrate", headers=AUTH).status_code == 422
    first = _plan(client, 0)
    plan, digest = first["plan"], first["digest"]
    ranks = _ranks(plan, digest, 3.0)
    bad_cases = [
        ({"ranks": [{**ranks[0], "plan_digest": "0" * 64}]}, 409, "not the digest of this plan"),
        ({"ranks": [{**ranks[0], "rank": 8}]}, 422, "not in the plan's world"),
        ({"ranks": [{**ranks[0], "micro_batch_times_s": [1.0] * 99}]}, 422, "micro-batches"),
        ({"plan": {**plan, "num_ranks": 10**18}}, 422, "num_ranks"),
        ({"cluster": "h200x32"}, 422, "has 32 GPUs"),
    ]
    for change, code, reason in bad_cases:
        body = {"plan": plan, "cluster": "h200x8", "ranks": ranks, **change}
        response = client.post(path, json=body, headers=AUTH)
        assert response.status_code == code and reason in response.text, response.text
    other = {**plan, "cost_model_id": "no-such-model"}
    other_digest = Plan.model_validate(other).digest()
    response = client.post(path, json={"plan": other, "cluster": "h200x8",
                                       "ranks": _ranks(other, other_digest, 1.0)}, headers=AUTH)
    assert response.status_code == 404
    stored = client.post(path, json={"plan": plan, "cluster": "h200x8", "ranks": ranks}, headers=AUTH).json()
    assert stored == {"digest": digest, "stored": 8, "duplicates": 0}
    for seed in range(1, 6):
        made = _plan(client, seed)
        assert client.post(path, json={"plan": made["plan"], "cluster": "h200x8",
                                       "ranks": _ranks(made["plan"], made["digest"], 3.0)},
                           headers=AUTH).status_code == 200

    revision = client.post(f"/v1/cost-models/{COST_MODEL}/recalibrate", headers=AUTH)
    assert revision.status_code == 201, revision.text
    body = revision.json()
    assert body["ref"] == f"{COST_MODEL}@1" and body["source_epoch"] is None
    assert math.isclose(body["scales"]["compute"], 3.0, rel_tol=0.1)
    assert body["fit"]["heldout_mape_before"] > 0.6 and body["fit"]["heldout_mape_after"] < 0.05
    assert body["fit"]["memory"] is None and body["scales"]["activation"] == 1.0  # no rank sent a peak
    again = _plan(client, 0, model=f"{COST_MODEL}@1")
    assert again["plan"]["cost_model_id"] == f"{COST_MODEL}@1"
    assert again["plan"]["predicted_step_time_s"] > 2.5 * plan["predicted_step_time_s"]
    missing = client.post("/v1/plans", json={"samples": [{"id": "a", "tokens": 100}], "cluster": "h200x8",
                                             "cost_model_id": f"{COST_MODEL}@9"}, headers=AUTH)
    assert missing.status_code == 404 and "revision" in missing.text
    # An epoch may start at a revision; its own recalibration makes the next one from the base.
    from .conftest import manifest_lines

    epoch = {"epoch_id": "at-rev", "manifest_jsonl": manifest_lines(32), "batch": {"samples_per_step": 8},
             "seed": 1, "cluster": "h200x8", "cost_model_id": f"{COST_MODEL}@1", "options": FAST}
    assert client.post("/v1/epochs", json=epoch, headers=AUTH).status_code == 202
    deadline = time.monotonic() + 60
    while client.get("/v1/epochs/at-rev").json()["state"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    views = [client.get(f"/v1/epochs/at-rev/steps/{s}/ranks/{r}", headers=AUTH).json()
             for s in range(2) for r in range(8)]
    steps = [{"step": v["step"], "rank": v["rank"], "plan_digest": v["plan_digest"],
              "micro_batch_times_s": [mb["predicted_time_s"] for mb in v["group"]["micro_batches"]]}
             for v in views]
    client.post("/v1/epochs/at-rev/recalibration", json={"follow": True, "every_steps": 2}, headers=AUTH)
    assert client.post("/v1/epochs/at-rev/measurements", json={"steps": steps}, headers=AUTH).status_code == 200
    report: dict[str, Any] = {}
    while time.monotonic() < deadline:
        report = client.get("/v1/epochs/at-rev/recalibration").json()
        if len(report["revisions"]) == 2 and not report["busy"]:
            break
        time.sleep(0.05)
    assert report["current_ref"] == f"{COST_MODEL}@2" and [e["rev"] for e in report["steps"]] == [1, 1]
    assert report["by_revision"][0]["mape"] < 1e-6  # @1 predicted these steps exactly
    assert all(math.isclose(v, w, rel_tol=0.05) for v, w in zip(report["revisions"][1]["scales"].values(),
                                                                  body["scales"].values(), strict=True))


def test_one_off_plans_with_peaks_refit_the_bytes_per_token(client: TestClient) -> None:
    truth = bytes_truth(client, 1.25)
    for seed in range(3):
        made = _plan(client, seed)
        plan = Plan.model_validate(made["plan"])
        ranks = _ranks(made["plan"], made["digest"], 1.0)
        peaks = {r: group_peak_bytes(truth, g) for g in plan.groups if g.micro_batches for r in g.ranks}
        for rank in ranks:
            rank["peak_bytes"] = int(peaks[rank["rank"]]) if rank["rank"] in peaks else None
        assert client.post("/v1/plans/measurements", json={"plan": made["plan"], "cluster": "h200x8",
                                                           "ranks": ranks}, headers=AUTH).status_code == 200
    revision = client.post(f"/v1/cost-models/{COST_MODEL}/recalibrate", headers=AUTH)
    assert revision.status_code == 201, revision.text
    body = revision.json()
    assert body["fit"]["memory"]["fitted"], body["fit"]
    assert math.isclose(body["scales"]["activation"], 1.25, rel_tol=1e-6)
    again = Plan.model_validate(_plan(client, 0, model=f"{COST_MODEL}@1")["plan"])
    for group in again.groups:
        if group.micro_batches:
            assert math.isclose(group.predicted_peak_mem_bytes, group_peak_bytes(truth, group), rel_tol=1e-6)
