"""Per-term scale factors: exact term split, fit on synthetic truth, robustness to a slow step."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.recalibrate import TermScales, fit_scales, scale_file, term_times_s
from costmodel.specs import ModelSpec, Sample

SPEC = ModelSpec(name="t", kind="1d", num_layers=3, hidden=16, num_heads=4, ffn_hidden=32, vocab=32)
CLUSTER = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": 4, "gpus_per_node": 4})
FILE = analytic_cost_model(SPEC, CLUSTER.hardware)
MODEL = CostModel(file=FILE, cluster=CLUSTER)
TRUTH = TermScales(compute=3.0, attention=5.0, alltoall=0.5, overhead=2.0)


def _data(*, sizes: tuple[int, ...] = (1, 2, 4), num_steps: int = 20, seed: int = 0
          ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Term times under FILE and times 'measured' under TRUTH with 3% log-normal noise."""
    rng = np.random.default_rng(seed)
    truth = CostModel(file=scale_file(FILE, TRUTH), cluster=CLUSTER)
    rows, measured, steps = [], [], []
    for step in range(num_steps):
        for d in sizes:
            samples = [Sample(id=f"s{i}", tokens=int(rng.integers(5, 5000)))
                       for i in range(int(rng.integers(1, 4)))]
            policies = [int(rng.integers(0, 4)) for _ in samples]
            rows.append(term_times_s(MODEL, samples, group_size=d, recompute_layers=policies))
            measured.append(truth.microbatch_time_s(samples, group_size=d, recompute_layers=policies)
                            * rng.lognormal(0, 0.03))
            steps.append(step)
    return np.array(rows), np.array(measured), steps


def test_terms_split_the_prediction_exactly_and_scale_linearly() -> None:
    samples = [Sample(id="a", tokens=700), Sample(id="b", tokens=90)]
    for d in (1, 2, 4):
        terms = term_times_s(MODEL, samples, group_size=d, recompute_layers=[3, 0])
        total = MODEL.microbatch_time_s(samples, group_size=d, recompute_layers=[3, 0])
        assert terms.sum() == pytest.approx(total, rel=1e-12)
        assert (terms[2] > 0) == (d > 1)  # all-to-all only in groups
        scaled = CostModel(file=scale_file(FILE, TRUTH), cluster=CLUSTER)
        assert scaled.microbatch_time_s(samples, group_size=d, recompute_layers=[3, 0]) == pytest.approx(
            float(terms @ TRUTH.as_array()), rel=1e-9)


def test_fit_predicts_held_out_steps_of_a_wrong_model() -> None:
    terms, measured, steps = _data()
    fit = fit_scales(terms, measured, steps=steps)
    q = fit.quality
    assert q.num_heldout == 12 and q.num_points == 48
    assert q.heldout_mape_before is not None and q.heldout_mape_before > 0.3
    assert q.heldout_mape_after is not None and q.heldout_mape_after < 0.05


def test_one_slow_step_barely_moves_the_predictions() -> None:
    terms, measured, steps = _data()
    clean = fit_scales(terms, measured, steps=steps).scales.as_array()
    slow = measured.copy()
    slow[np.array(steps) == 3] *= 10.0  # a straggler step, every group 10x slower
    moved = fit_scales(terms, slow, steps=steps).scales.as_array()
    change = np.abs(terms @ moved / (terms @ clean) - 1.0)
    assert change.max() < 0.03, change.max()


def test_a_term_without_signal_keeps_its_prior_factor() -> None:
    terms, measured, steps = _data(sizes=(1,))
    fit = fit_scales(terms, measured, steps=steps, prior=TermScales(alltoall=0.7))
    assert fit.scales.alltoall == 0.7
    assert "alltoall" not in fit.quality.active_terms


def test_bad_input_is_refused() -> None:
    terms, measured, steps = _data(num_steps=2)
    with pytest.raises(ValueError, match="finite and positive"):
        fit_scales(terms, np.where(np.arange(len(measured)) == 0, np.nan, measured), steps=steps)
    with pytest.raises(ValueError, match="one measurement and step per row"):
        fit_scales(terms, measured[:-1], steps=steps)
    with pytest.raises(ValueError, match="must be finite and positive"):
        TermScales(compute=0.0)
