"""The published kernel-efficiency curves of the analytic default, counted by hand from the points
of costmodel/presets/kernel_efficiency.json (FlashAttention-3 Fig. 5/6 on H100; OpenXLA's GEMM
tables), and what the cost model charges with them."""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np
import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.efficiency_report import kernel_efficiencies
from costmodel.evaluate import CostModel
from costmodel.kernel_efficiency import fit_gemm, hardware_with_curves, kernel_efficiency
from costmodel.model_terms import linear_flops_per_token_layer
from costmodel.pass_terms import attention_s
from costmodel.presets import load_cluster, load_hardware, load_model
from costmodel.schema import CostModelFile, EfficiencyCurve

PEAK = 989e12


def _table() -> dict:
    return json.loads(resources.files("costmodel").joinpath("presets", "kernel_efficiency.json").read_text())


def test_every_point_names_a_source_and_curves_rise() -> None:
    table = _table()
    for name, hw in table["hardware"].items():
        curves = [*hw.get("attention", []), *([hw["gemm"]] if "gemm" in hw else [])]
        assert curves or "same_as" in hw, name
        for curve in curves:
            for size, tflops, source in curve["points"]:
                assert source in table["sources"], (name, size, source)
                assert 0 < tflops <= hw["peak_tflops"]
            sizes = [p[0] for p in curve["points"]]
            assert sizes == sorted(sizes)
            assert [p[1] for p in curve["points"]] == sorted(p[1] for p in curve["points"]), (name, curve)
    assert {"h100-sxm", "h200-sxm", "b200"} <= set(hardware_with_curves())


def test_interpolation_by_hand() -> None:
    """H100, head dim 128, causal forward (FA3 Fig. 5(d)): 292 TFLOP/s at 512, 423 at 1k, ... 616 at 16k."""
    curve = kernel_efficiency("h100-sxm", head_dim=128, causal=True).attention.forward  # type: ignore[union-attr]
    # log-linear: half-way in ln(tokens) between 512 and 1024 is 512*sqrt(2)
    assert float(curve.at(512 * math.sqrt(2))) == pytest.approx((292 + 423) / 2 / 989)
    assert float(curve.at(1024)) == pytest.approx(423 / 989)
    # a quarter of the way from 2k to 4k in ln(tokens)
    assert float(curve.at(2048 * 2 ** 0.25)) == pytest.approx((521 + 0.25 * (579 - 521)) / 989)
    # the plateau past the last point
    assert float(curve.at(131072)) == pytest.approx(616 / 989)
    # below the first point the first segment's slope continues (256: 292 - 131 = 161) ...
    assert float(curve.at(256)) == pytest.approx(161 / 989)
    # ... but never below proportionally scaled work (64: 292/8, the slope would give 292 - 3*131 < 0)
    assert float(curve.at(64)) == pytest.approx(292 / 8 / 989)
    assert float(curve.time_multiplier(1024)) == pytest.approx(616 / 423)
    with pytest.raises(ValueError, match="positive"):
        curve.at(0)


def test_gemm_hockney_fit_by_hand() -> None:
    """H100 GEMMs (OpenXLA sm_90, m x 4096 x 4096): 412.03, 738.47, 783.33 TFLOP/s at m = 256, 1k, 4k."""
    fit = kernel_efficiency("h100-sxm", head_dim=128, causal=True).gemm  # type: ignore[union-attr]
    e_inf = 783.33 / 989
    x = [1 / 256, 1 / 1024, 1 / 4096]
    y = [989 / 412.03 - 1 / e_inf, 989 / 738.47 - 1 / e_inf, 0.0]
    slope = sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)
    assert fit.peak_efficiency == pytest.approx(e_inf)
    assert fit.half_rows == pytest.approx(slope * e_inf)
    assert 150 < fit.half_rows < 300
    with pytest.raises(ValueError, match="two points"):
        fit_gemm(EfficiencyCurve(tokens=[1.0], efficiency=[0.5]))


def test_llama31_8b_on_h100_times_by_hand() -> None:
    """One sample of 4,096 tokens on one H100: dense parts at the best GEMM point, attention at the
    FA3 points of its 4k-token kernel (forward causal 579, backward 542 TFLOP/s)."""
    model = load_model("llama-3.1-8b")
    cm = CostModel(file=analytic_cost_model(model, load_hardware("h100-sxm")), cluster=load_cluster("h100x16"))
    s, layers, h, kv_dim, ffn, vocab = 4096, 32, 4096, 1024, 14336, 128256
    lin_flops = 2 * (2 * h * h + 2 * h * kv_dim + 3 * h * ffn)
    assert linear_flops_per_token_layer(model) == lin_flops == 436_207_616
    lin = 783.33e12
    fwd = lin_flops * s / lin + 2 * h * s * s / 579e12  # causal: 2*inner FLOPs a pair
    bwd = 2 * lin_flops * s / lin + 2.5 * 2 * h * s * s / 542e12
    head = 4 * 2 * h * vocab * s / lin  # forward, backward (2x) and the chunked loss's recompute
    assert float(cm.sample_time_s(s, group_size=1)) == pytest.approx(layers * (fwd + bwd) + head, rel=1e-9)
    # the kernel runs over the whole sample on every rank of a Ulysses group: its efficiency does
    # not change with d, the attention time halves
    c = cm.file.compute
    one = attention_s(c.forward, np.asarray(float(s)), np.asarray(1.0), np.asarray(float(s)), attention="whole",
                      group_size=1.0, half_tokens=0.0, efficiency=c.attention_efficiency.forward)  # type: ignore[union-attr]
    two = attention_s(c.forward, np.asarray(float(s)), np.asarray(1.0), np.asarray(float(s)), attention="whole",
                      group_size=2.0, half_tokens=0.0, efficiency=c.attention_efficiency.forward)  # type: ignore[union-attr]
    assert float(two) == pytest.approx(float(one) / 2)


def test_a_short_kernel_is_priced_slower_per_pair_by_the_curves_ratio() -> None:
    cm = CostModel(file=analytic_cost_model(load_model("llama-3.1-8b"), load_hardware("h100-sxm")),
                   cluster=load_cluster("h100x16"))
    c = cm.file.compute
    curves = c.attention_efficiency
    assert curves is not None

    def per_pair(tokens: int, terms, curve) -> float:  # type: ignore[no-untyped-def]
        t = np.asarray(float(tokens))
        return float(attention_s(terms, t, np.asarray(1.0), t, attention="whole", group_size=1.0, half_tokens=0.0,
                                 efficiency=curve)) / tokens**2

    assert per_pair(1024, c.forward, curves.forward) / per_pair(16384, c.forward, curves.forward) == pytest.approx(
        616 / 423)
    assert per_pair(1024, c.backward, curves.backward) / per_pair(16384, c.backward, curves.backward) == (
        pytest.approx(561 / 424))
    # and the shares of peak dcp cost reports are the published points
    eff = kernel_efficiencies(cm, tokens=1024, group_size=1)
    assert eff.attention_forward == pytest.approx(423 / 989)
    assert eff.attention_backward == pytest.approx(424 / 989)
    half = kernel_efficiency("h100-sxm", head_dim=128, causal=True).gemm.half_rows  # type: ignore[union-attr]
    assert eff.gemm == pytest.approx(783.33 / 989 * 1024 / (1024 + half))
    assert kernel_efficiencies(cm, tokens=1024, group_size=8).gemm == pytest.approx(783.33 / 989 * 128 / (128 + half))


def test_h200_borrows_h100_and_b200_scales_its_shape() -> None:
    h100 = kernel_efficiency("h100-sxm", head_dim=128, causal=False)
    h200 = kernel_efficiency("h200-sxm", head_dim=128, causal=False)
    b200 = kernel_efficiency("b200", head_dim=128, causal=False)
    assert h100 is not None and h200 is not None and b200 is not None
    assert h200.attention == h100.attention and h200.gemm.curve == h100.gemm.curve
    assert "h100-sxm" in h200.notes
    # B200: the best H100 point (756 TFLOP/s, head dim 256 forward) becomes FA4's 71%
    assert b200.attention.forward.efficiency[-1] == pytest.approx(648 / 756 * 0.71)
    assert b200.gemm.curve.efficiency[0] == pytest.approx(651.39 / 2250)
    assert b200.peak_flops == 2250e12
    # head dims without a published backward (256) take the nearest one and say so
    wan_like = kernel_efficiency("h100-sxm", head_dim=256, causal=False)
    assert wan_like is not None and "backward head dim 128 used for 256" in wan_like.notes
    # a hardware without a table keeps the constant efficiencies
    assert kernel_efficiency("a100-80g", head_dim=128, causal=True) is None
    a100 = analytic_cost_model(load_model("llama-7b"), load_hardware("a100-80g"))
    assert a100.compute.attention_efficiency is None and a100.compute.attention_half_tokens == 512


def test_the_curves_round_trip_and_stay_out_of_files_without_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    file = analytic_cost_model(load_model("wan2.1-14b"), load_hardware("h200-sxm"))
    assert file.compute.attention_efficiency is not None
    file.save(tmp_path / "m.json")
    back = CostModelFile.load(tmp_path / "m.json")
    assert back == file and back.digest() == file.digest()
    plain = analytic_cost_model(load_model("llama-7b"), load_hardware("a100-80g"))
    assert "attention_efficiency" not in plain.model_dump(mode="json")["compute"]
    with pytest.raises(ValueError, match="increasing"):
        EfficiencyCurve(tokens=[2.0, 1.0], efficiency=[0.2, 0.3])
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        EfficiencyCurve(tokens=[1.0, 2.0], efficiency=[0.2, 1.3])
