"""Memory recalibration: the per-token bytes factor from measured step peaks."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.recalibrate import TermScales, scale_file
from costmodel.recalibrate_memory import fit_activation_scale, step_peak_parts_bytes
from costmodel.specs import ModelSpec, Sample

SPEC = ModelSpec(name="t", kind="1d", num_layers=4, hidden=256, num_heads=4, ffn_hidden=512, vocab=64)
CLUSTER = load_cluster("h200x8")
FILE = analytic_cost_model(SPEC, CLUSTER.hardware)
MODEL = CostModel(file=FILE, cluster=CLUSTER)


def _by_hand(factor: float) -> CostModel:
    """The truth: every per-token byte coefficient times ``factor``, written out field by field
    (not through ``scale_file``, which is under test too)."""
    act = FILE.activation
    truth = FILE.model_copy(update={"activation": act.model_copy(update={
        "bytes_per_token_layer_none": act.bytes_per_token_layer_none * factor,
        "bytes_per_token_layer_full": act.bytes_per_token_layer_full * factor,
        "working_bytes_per_token": act.working_bytes_per_token * factor,
        "transient_bytes_per_token": act.transient_bytes_per_token * factor,
        "head_transient_bytes_per_token": act.head_transient_bytes_per_token * factor,
        "alltoall_buffer_bytes_per_token": act.alltoall_buffer_bytes_per_token * factor})})
    return CostModel(file=truth, cluster=CLUSTER)


def _steps(num: int, *, tokens_lo: int = 20_000, tokens_hi: int = 200_000, seed: int = 0
           ) -> list[tuple[int, list[tuple[list[Sample], list[int]]]]]:
    rng = np.random.default_rng(seed)
    steps = []
    for j in range(num):
        d = int(rng.choice([1, 2, 4]))
        mbs = []
        for m in range(int(rng.integers(1, 4))):
            samples = [Sample(id=f"s{j}-{m}-{i}", tokens=int(rng.integers(tokens_lo, tokens_hi)))
                       for i in range(int(rng.integers(1, 3)))]
            mbs.append((samples, [int(rng.integers(0, SPEC.num_layers + 1)) for _ in samples]))
        steps.append((d, mbs))
    return steps


def _peak(model: CostModel, d: int, mbs: list[tuple[list[Sample], list[int]]]) -> float:
    return max(model.microbatch_peak_bytes(samples, group_size=d, recompute_layers=policies)
               for samples, policies in mbs)


def test_the_fit_recovers_the_factor_and_no_measured_step_is_under_predicted_after() -> None:
    truth = _by_hand(1.4)
    steps = _steps(24)
    parts = [step_peak_parts_bytes(MODEL, mbs, group_size=d) for d, mbs in steps]
    measured = [_peak(truth, d, mbs) for d, mbs in steps]
    # the parts add up to the model's own peak of the step
    for (d, mbs), (fixed, var) in zip(steps, parts, strict=True):
        assert fixed + var == pytest.approx(_peak(MODEL, d, mbs), rel=1e-12)
    fit = fit_activation_scale([f for f, _ in parts], [v for _, v in parts], measured)
    assert fit.fitted and fit.num_points > 0
    assert fit.factor == pytest.approx(1.4, rel=1e-9)
    assert fit.max_under_before is not None and fit.max_under_before > 0.05
    assert fit.max_under_after is not None and fit.max_under_after <= 1e-12
    assert fit.mape_after is not None and fit.mape_before is not None and fit.mape_after < 1e-9 < fit.mape_before
    # the factor written into a file predicts the truth's peaks
    scaled = CostModel(file=scale_file(FILE, TermScales(activation=fit.factor)), cluster=CLUSTER)
    for d, mbs in steps:
        assert _peak(scaled, d, mbs) == pytest.approx(_peak(truth, d, mbs), rel=1e-9)


def test_a_model_that_overstates_the_bytes_gets_a_factor_below_one() -> None:
    truth = _by_hand(0.7)
    steps = _steps(12, seed=1)
    parts = [step_peak_parts_bytes(MODEL, mbs, group_size=d) for d, mbs in steps]
    fit = fit_activation_scale([f for f, _ in parts], [v for _, v in parts],
                               [_peak(truth, d, mbs) for d, mbs in steps])
    assert fit.factor == pytest.approx(0.7, rel=1e-9)
    assert fit.max_under_before is not None and fit.max_under_before < 0


def test_the_largest_ratio_decides_and_steps_with_few_per_token_bytes_are_left_out() -> None:
    fixed = [10e9, 10e9, 10e9, 10e9]
    var = [20e9, 40e9, 30e9, 0.5e9]
    # two steps at 1.2x, one at 1.5x, and a few-token step whose peak is 3 GB over the fixed
    # bytes (allocator slack, or fixed bytes the model misses): 7x its per-token bytes
    measured = [10e9 + 1.2 * 20e9, 10e9 + 1.2 * 40e9, 10e9 + 1.5 * 30e9, 10e9 + 3.5e9]
    fit = fit_activation_scale(fixed, var, measured)
    assert fit.num_points == 3 and fit.num_measured == 4
    assert fit.factor == pytest.approx(1.5)


def test_without_a_usable_step_the_prior_stays() -> None:
    # the fixed bytes alone are over every measured peak: nothing says what a token costs
    fit = fit_activation_scale([50e9, 50e9], [20e9, 30e9], [40e9, 45e9], prior=1.3)
    assert not fit.fitted and fit.factor == 1.3
    empty = fit_activation_scale([], [], [], prior=0.9)
    assert not empty.fitted and empty.factor == 0.9 and empty.max_under_before is None


@pytest.mark.parametrize(("fixed", "var", "peak", "match"), [
    ([1.0], [1.0, 2.0], [3.0], "equal-length"),
    ([1.0], [-1.0], [3.0], "var_bytes must be finite"),
    ([1.0], [1.0], [float("nan")], "measured_peak_bytes must be finite and positive"),
    ([1.0], [1.0], [0.0], "measured_peak_bytes must be finite and positive"),
])
def test_bad_input_names_the_value(fixed: list[float], var: list[float], peak: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_activation_scale(fixed, var, peak)
    with pytest.raises(ValueError, match="activation=0"):
        TermScales(activation=0.0)
