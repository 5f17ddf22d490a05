"""Closing the loop on gloo: measured step times -> recalibrated cost model -> re-planned steps.

A real ``dcp serve``; 2 or 4 ranks (4: two SP-2 groups at once, 4 processes on the CI's 2
cores) train a reference model (1D, and 2D with spatial and temporal attention) under a
deliberately wrong cost model
(the analytic model of the H200, compute made 2x too fast on top, and for 2D the fixed costs
4x too small), post their measured
micro-batch times, the service fits a revision and re-plans the steps nobody fetched. Asserted
on what the ranks measured: the prediction error of the re-planned steps is far below that of
the first steps; fetched steps kept their digest; every step kept its samples.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.recalibrate import TermScales, scale_file
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from dcp_cli.net import free_port
from planner.plan import Plan
from tests.executor import recalibration_ranks
from tests.executor.helpers import CONFIG
from tests.executor.service import OPTIONS, Service
from tests.executor.worlds import spawn_world

# Its bars compare predictions with the ranks' measured times: run with nothing beside it (make
# test runs the ``alone`` tests after the two-worker part; a 4-rank run beside a second worker at
# load ~6 ended at |ln| 1.24 after 3.47, 0.36 of the start against the 0.3 bar).
pytestmark = pytest.mark.alone

EPOCH = "recal-e2e"
STEPS_A, STEPS_B = 5, 6
SAMPLES_PER_STEP = 8


def wrong_setup(world: int, kind: str = "1d") -> tuple[ClusterSpec, list[Sample], dict[str, object]]:
    """A CPU 'cluster' whose memory forces SP groups on long samples, a manifest, and the
    deliberately wrong cost model (analytic H200 coefficients, compute x0.5; 2D: fixed costs x0.25).

    Why 2D also scales the fixed costs: its H200 prediction is dominated by per-layer-call
    overheads, which put it within 2-3x of a CPU's time on some days (|ln| 0.8-0.95 on 2026-12-04
    here and in CI against 1.2-2.5 before), so "x0.5 on compute" alone no longer made a start that
    is far off. With fixed costs x0.25 both kinds start ~15-25x too fast."""
    spec = ModelSpec(name=f"ref-recal-{kind}", kind=kind, num_layers=CONFIG.num_layers, hidden=CONFIG.hidden,
                     num_heads=CONFIG.num_heads, ffn_hidden=CONFIG.ffn_hidden,
                     vocab=CONFIG.vocab if kind == "1d" else 0, causal=kind == "1d",
                     mlp="swiglu" if kind == "1d" else "gelu")
    cluster = load_cluster("h200x8").model_copy(update={"name": f"cpu{world}", "num_gpus": world,
                                                        "gpus_per_node": world})
    analytic = analytic_cost_model(spec, cluster.hardware)
    model = CostModel(file=analytic, cluster=cluster)
    need = model.fixed_bytes() + float(model.activation_bytes(160, group_size=1))  # 160 tokens fill a rank
    hardware = cluster.hardware.model_copy(update={"name": "h200-tight",
                                                   "hbm_bytes": need / cluster.memory_cap_fraction})
    cluster = cluster.model_copy(update={"hardware": hardware})
    scales = TermScales(compute=0.5, overhead=0.25 if kind == "2d" else 1.0)
    wrong = scale_file(analytic.model_copy(update={"hardware": "h200-tight"}), scales, new_id=f"ref-recal-{kind}-wrong")
    count = SAMPLES_PER_STEP * (STEPS_A + STEPS_B)
    if kind == "1d":
        samples = [Sample(id=f"r{i}", tokens=8 + (i * 53) % 400) for i in range(count)]
    else:  # clips of 1-8 frames of 2x2..6x6 patches (4-288 tokens)
        samples = [Sample(id=f"v{i}", frames=1 + (i * 5) % 8, height=2 + (i * 3) % 5, width=2 + (i * 7) % 5)
                   for i in range(count)]
    return cluster, samples, wrong.model_dump(mode="json")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "world"), [("1d", 2), ("2d", 2), ("1d", 4), ("2d", 4)])
def test_measured_error_drops_after_recalibration_and_fetched_steps_stay(service: Service, tmp_path: Path,
                                                                         kind: str, world: int) -> None:
    epoch = f"{EPOCH}-{kind}-{world}"
    cluster, samples, wrong = wrong_setup(world, kind)
    url = service.url
    assert httpx.post(f"{url}/v1/cost-models", json=wrong, timeout=30).status_code in (200, 201)
    body = {"epoch_id": epoch, "manifest_jsonl": "\n".join(json.dumps(s.model_dump(exclude_none=True))
                                                           for s in samples),
            "batch": {"samples_per_step": SAMPLES_PER_STEP}, "seed": 0, "cluster": cluster.model_dump(mode="json"),
            "cost_model_id": wrong["id"], "options": OPTIONS}
    assert httpx.post(f"{url}/v1/epochs", json=body, timeout=30).status_code == 202
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/epochs/{epoch}", timeout=10).json()["state"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    settings = httpx.post(f"{url}/v1/epochs/{epoch}/recalibration", json={"follow": True, "every_steps": STEPS_A},
                          timeout=30)
    assert settings.status_code == 200, settings.text
    before = {r["step"]: r for r in httpx.get(f"{url}/v1/epochs/{epoch}/steps", params={"stop": 64},
                                              timeout=30).json()}

    spawn_world(recalibration_ranks.worker, nprocs=world,
                args=(world, free_port(), url, epoch, json.dumps([s.model_dump(exclude_none=True) for s in samples]),
                      STEPS_A, STEPS_B, str(tmp_path), kind))

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["dropped"] == 0 and r["posted"] == STEPS_A + STEPS_B for r in ranks), ranks
    report = httpx.get(f"{url}/v1/epochs/{epoch}/recalibration", timeout=30).json()
    after = {r["step"]: r for r in httpx.get(f"{url}/v1/epochs/{epoch}/steps", params={"stop": 64},
                                             timeout=30).json()}
    # Fetched steps never changed; every step kept its samples; later steps use a revision.
    for step, old in before.items():
        new = after[step]
        assert sorted(Plan.model_validate(new["plan"]).sample_ids) == sorted(
            Plan.model_validate(old["plan"]).sample_ids)
        if step < STEPS_A:
            assert new["digest"] == old["digest"]
    for r in ranks:
        for step, digest in r["fetched"].items():
            assert after[int(step)]["digest"] == digest  # what ranks ran is what is stored
    revs = {e["step"]: e["rev"] for e in report["steps"]}
    assert all(revs[s] == 0 for s in range(STEPS_A)) and all(revs[s] >= 1 for s in range(STEPS_A, STEPS_A + STEPS_B))
    # Measured, not constructed: the plans' own predictions against the ranks' timings. On the
    # shared 2-core box the timings of equal micro-batches spread 2-3x (bench/README.md), so the
    # bar is a clear drop, not a small error: before, predictions are ~20x too fast (MAPE 95%,
    # |ln| 3.0); after, 10%, 15% and 40% (|ln| 0.1, 0.2, 0.6) in three runs at load 9-12; over 6
    # steps after the fit, |ln| 0.19 mean, 0.22 worst (after / before <= 0.08) in 8 runs at load ~2;
    # with 4 ranks, after / before 0.10 median, 0.13 worst in 7 runs.
    before_err = next(e for e in report["by_revision"] if e["rev"] == 0)
    later = [e for e in report["by_revision"] if e["rev"] >= 1]
    count = sum(e["num_steps"] for e in later)
    later_mape = sum(e["mape"] * e["num_steps"] for e in later) / count
    later_log = sum(e["mean_abs_log_ratio"] * e["num_steps"] for e in later) / count
    print("recalibration e2e:", json.dumps({"by_revision": report["by_revision"],
                                            "revisions": [(r["ref"], r["scales"], r["fit"])
                                                          for r in report["revisions"]]}))
    # 2D (spatial + temporal attention, clips of 4-288 tokens) is recalibrated less well from the
    # H200 model, whose shape (overheads against work) is far from a CPU's. With compute x0.5 only
    # it started ~5-9x too fast (MAPE 74-88%, |ln| 1.2-2.5) until 2026-12-03, then 2.2-2.6x (|ln|
    # 0.8-0.95) here and in CI, so the fixed costs are scaled x0.25 too: before |ln| 2.4-3.3,
    # after 0.17-0.48 in 4 runs each with 2 and 4 ranks (after / before 0.07-0.17, load ~1). The
    # after-error is the box's noise, as it was from the older start: the same micro-batch's time
    # spreads sd(ln) 0.26 between runs, and a fit on all of a run's steps leaves sd(ln) 0.24
    # (older start: |ln| after 0.2-0.55 with 2 ranks, 0.55 the worst seen in CI). Under heavy
    # load (this suite beside two other jobs, load ~5) one 2-rank run ended at 1.06 after 3.33
    # (0.32: the 5-step fit put the slowdown in the fixed costs, x37). The bar stays 0.45 of the
    # start: scaled by one common factor instead of per term, 2-rank records gave |ln| 0.44 mean,
    # 0.90 worst. Over-prediction has no MAPE ceiling
    # (0.78 after against 0.79 before in one CI run), so both kinds are judged on |ln|, which
    # weighs too slow and too fast alike: 1D with 4 ranks beside a second test worker (load ~8)
    # once ended at MAPE 1.78 after 0.99 (predictions 2.8x too slow: the fit's steps ran under
    # heavier load than the later ones) while |ln| fell 4.52 -> 0.80 (0.18 of the start). The
    # first check only says the start is far off (how far depends on the machine's speed that day).
    before_mape, before_floor, log_ratio = (0.8, 2.0, 0.3) if kind == "1d" else (0.7, 1.5, 0.45)
    assert before_err["mape"] > before_mape and before_err["mean_abs_log_ratio"] > before_floor, before_err
    assert later_log < log_ratio * before_err["mean_abs_log_ratio"], (before_err, later, later_mape)
