"""Recalibration prices each measured group on its own attention layout (issue 25 follow-up):
measured ring plans are split into terms, and their peaks into parts, as rings, not as Ulysses.

One-off plans under ``layout="ring"`` (every group of two or more ranks a ring) are "measured" at
exactly their predicted micro-batch times and group peaks: a model that is right needs no change,
so the fitted factors stay 1 and the prior's error is ~0. The same records priced as pure Ulysses
(the split before this change) miss by percents, and their peaks need a larger memory factor."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from fastapi.testclient import TestClient

from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.presets import builtin_cost_model_files, load_cluster
from costmodel.recalibrate import TermSplitter
from costmodel.recalibrate_memory import step_peak_parts_bytes
from costmodel.specs import Sample

from .conftest import AUTH, COST_MODEL, FAST


def _plan(client: TestClient, seed: int) -> dict[str, Any]:
    samples = [{"id": f"r{seed}-{i}", "tokens": 2048 * (1 + (i * 5 + seed) % 24)} for i in range(12)]
    response = client.post("/v1/plans", json={"samples": samples, "cluster": "h200x8", "cost_model_id": COST_MODEL,
                                              "options": {**FAST, "layout": "ring"}}, headers=AUTH)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _ranks(plan: dict[str, Any], digest: str) -> list[dict[str, Any]]:
    return [{"rank": r, "plan_digest": digest, "peak_bytes": int(g["predicted_peak_mem_bytes"]),
             "micro_batch_times_s": [mb["predicted_time_s"] for mb in g["micro_batches"]]}
            for g in plan["groups"] for r in g["ranks"]]


def test_measured_ring_plans_are_recalibrated_as_rings(client: TestClient) -> None:
    plans = []
    for seed in range(6):
        made = _plan(client, seed)
        plans.append(made["plan"])
        response = client.post("/v1/plans/measurements", json={"plan": made["plan"], "cluster": "h200x8",
                                                                "ranks": _ranks(made["plan"], made["digest"])},
                               headers=AUTH)
        assert response.status_code == 200, response.text
    rings = [g for p in plans for g in p["groups"] if g.get("ring_degree", 1) > 1]
    assert rings and all(g["ring_degree"] == len(g["ranks"]) for g in rings)

    revision = client.post(f"/v1/cost-models/{COST_MODEL}/recalibrate", headers=AUTH)
    assert revision.status_code == 201, revision.text
    body = revision.json()
    assert body["fit"]["train_mape_before"] < 1e-6 and body["fit"]["heldout_mape_before"] < 1e-6, body["fit"]
    for term in ("compute", "attention", "overhead"):
        assert math.isclose(body["scales"][term], 1.0, rel_tol=1e-3), body["scales"]
    assert math.isclose(body["scales"]["activation"], 1.0, rel_tol=1e-3), body["fit"]["memory"]

    # the split before layouts: every group priced as pure Ulysses of its size
    cluster = load_cluster("h200x8")
    file = next(f for f in builtin_cost_model_files() if f.id == COST_MODEL)
    model = CostModel(file=file, cluster=cluster)
    split = TermSplitter(model)
    ratios, peak_ratios = [], []
    for g in rings:
        first, size = g["ranks"][0], len(g["ranks"])
        micro = [([Sample.model_validate(ps["sample"]) for ps in mb["samples"]],
                  [ps["recompute_layers"] for ps in mb["samples"]]) for mb in g["micro_batches"]]
        for (samples, policies), mb in zip(micro, g["micro_batches"], strict=True):
            as_ulysses = split(samples, group_size=size, recompute_layers=policies, num_nodes=nodes_spanned(
                first_rank=first, group_size=size, gpus_per_node=cluster.gpus_per_node)).sum()
            ratios.append(as_ulysses / mb["predicted_time_s"])
        fixed, var = step_peak_parts_bytes(model, micro, group_size=size)
        peak_ratios.append(g["predicted_peak_mem_bytes"] / (fixed + var))
    assert float(np.mean(np.abs(np.array(ratios) - 1))) > 0.01, ratios  # > 1% MAPE as Ulysses
    assert max(peak_ratios) > 1.0 + 1e-6, peak_ratios  # the ring's key/value buffers were missing
