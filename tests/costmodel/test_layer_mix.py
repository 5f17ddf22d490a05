"""Mixture-of-experts and sliding-window models against hand counts (gpt-oss-20b, Qwen3-30B-A3B,
Gemma-3-27B): parameters, FLOPs, kept bytes, attention pairs, times, model states and the
expert-parallel all-to-alls."""

from __future__ import annotations

import re

import pytest

from costmodel.analytic import (
    AnalyticConfig,
    activation_bytes_per_token_layer,
    analytic_cost_model,
    linear_flops_per_token_layer,
    num_params,
)
from costmodel.evaluate import CostModel
from costmodel.layer_mix import attention_pairs
from costmodel.presets import load_cluster, load_hardware, load_model
from costmodel.specs import ModelSpec

H200_PEAK = 989e12
CONSTANTS = AnalyticConfig(kernel_curves=False)
"""The constant efficiencies (attention ``pairs/d + 512 pairs/s``), so that times count by hand."""


def _cost_model(name: str, cluster: str = "h200x8", config: AnalyticConfig | None = None,
                **overrides: object) -> CostModel:
    return _bind(load_model(name), cluster, config, **overrides)


def _bind(model: ModelSpec, cluster: str = "h200x8", config: AnalyticConfig | None = None,
          **overrides: object) -> CostModel:
    return CostModel(file=analytic_cost_model(model, load_hardware("h200-sxm"), config=config),
                     cluster=load_cluster(cluster, **overrides))


def test_gpt_oss_20b_params_and_flops_by_hand() -> None:
    m = load_model("gpt-oss-20b")
    h, inner, kv, f_e, experts, k, heads, layers, v = 2880, 64 * 64, 8 * 64, 2880, 32, 4, 64, 24, 201088
    attention = h * inner + 2 * h * kv + inner * h
    layer = attention + experts * 3 * h * f_e + h * experts + heads + 2 * h  # experts, router, sinks, norms
    # The public count is 20.9B (20,914,757,184 with the biases this model leaves out).
    assert num_params(m) == layers * layer + 2 * v * h + h == 20_907_928_896
    # Per token: the 4 routed experts and the router, not all 32.
    assert linear_flops_per_token_layer(m) == 2 * (attention + k * 3 * h * f_e + h * experts)


def test_qwen3_moe_flops_and_bytes_by_hand() -> None:
    m = load_model("qwen3-30b-a3b")
    h, inner, kv, f_e, experts, k, heads = 2048, 32 * 128, 4 * 128, 768, 128, 8, 32
    assert num_params(m) == 30_532_110_336  # public: 30.5B
    assert linear_flops_per_token_layer(m) == 2 * (h * inner + 2 * h * kv + inner * h + k * 3 * h * f_e + h * experts)
    none, full = activation_bytes_per_token_layer(m)
    attention = 2 * (2 * h + 2 * inner + 2 * kv) + 4 * heads
    # MoE block: the norm's input and the block input, per routed copy its gathered input, the
    # down output and its weighted copy (3h), gate/up, activation and product (4 f_e) and the
    # weight; fp32 router probabilities; int64 top-k, token and slot indices.
    moe = 2 * (2 * h + k * (3 * h + 4 * f_e + 1)) + 4 * experts + 8 * 3 * k
    assert none == attention + moe
    assert full == 2 * h


def test_qwen3_moe_dense_layers_follow_the_pattern() -> None:
    base = load_model("qwen3-30b-a3b")
    sparse = ModelSpec(**{**base.model_dump(), "num_layers": 4, "dense_mlp_layers": (0, 2)})
    h, f, f_e, experts, k = 2048, 6144, 768, 128, 8
    dense_mlp, moe_mlp = 3 * h * f, k * 3 * h * f_e + h * experts
    attention = h * 4096 + 2 * h * 512 + 4096 * h
    assert linear_flops_per_token_layer(sparse) == 2 * (attention + (2 * dense_mlp + 2 * moe_mlp) / 4)
    assert sparse.num_moe_layers == 2


def test_window_pairs_by_hand() -> None:
    m = load_model("gemma-3-27b")  # 62 layers, 52 of them a 1,024-token window
    assert (m.num_layers, m.num_sliding_layers, m.sliding_window) == (62, 52, 1024)
    s = 8192.0
    windowed = s * s - (s - 1024) * (s - 1024 + 1)  # sum_i min(i+1, w) pairs, twice, less s, as s^2 counts them
    assert float(attention_pairs(m, s)) == pytest.approx((10 * s * s + 52 * windowed) / 62, rel=1e-15)
    # Inside the window a windowed layer is a full one.
    assert float(attention_pairs(m, 1000.0)) == 1000.0 ** 2
    # Count the pairs one by one on a small case.
    small = ModelSpec(name="w", kind="1d", num_layers=1, hidden=8, num_heads=2, ffn_hidden=8,
                      layer_types=("sliding_attention",), sliding_window=3)
    pairs = sum(min(i + 1, 3) for i in range(10))
    assert float(attention_pairs(small, 10.0)) == 2 * pairs - 10  # s^2 units: twice the pairs less s
    assert float(attention_pairs(ModelSpec(**{**small.model_dump(), "sliding_window": 10}), 10.0)) == 10 * 10


def test_windowed_time_by_hand() -> None:
    cm = _cost_model("gemma-3-27b", config=CONSTANTS)
    m = cm.file.model
    s, d, layers = 32768.0, 2, 62
    attn_rate, lin_rate = H200_PEAK * 0.5, H200_PEAK * 0.6
    pairs = (10 * s * s + 52 * (s * s - (s - 1024) * (s - 1023))) / 62
    per_pair = 2 * 32 * 128 / attn_rate  # causal: 2 * inner FLOPs a pair
    attention = pairs / d + 512 * pairs / s
    linear = linear_flops_per_token_layer(m) * s / d / lin_rate
    head = cm.file.compute.head_s_per_token * s / d
    a2a = float(cm.sample_time_s(s, group_size=d)) - (
        layers * (3 * linear + 3.5 * per_pair * attention) + head)
    # What is left is the Ulysses all-to-alls: the same as for a full-attention twin.
    full = ModelSpec(**{**m.model_dump(), "layer_types": None, "sliding_window": None})
    twin = _bind(full, config=CONSTANTS)
    twin_attention = s * s / d + 512 * s
    twin_a2a = float(twin.sample_time_s(s, group_size=d)) - (
        layers * (3 * linear + 3.5 * per_pair * twin_attention) + head)
    assert a2a == pytest.approx(twin_a2a, rel=1e-6)
    assert a2a > 0
    assert float(cm.sample_time_s(s, group_size=d)) < 0.8 * float(twin.sample_time_s(s, group_size=d))
    # With the published kernel curves (the default) the windowed layers save as much attention
    # time: the curve multiplies the pairs of either by the same factor at s tokens.
    curved, curved_twin = _cost_model("gemma-3-27b"), _bind(full)
    saved = float(curved_twin.sample_time_s(s, group_size=d)) - float(curved.sample_time_s(s, group_size=d))
    curves = curved.file.compute.attention_efficiency
    assert curves is not None
    c = curved.file.compute
    per_pair = (c.forward.per_attn_pair * float(curves.forward.time_multiplier(s))
                + c.backward.per_attn_pair * float(curves.backward.time_multiplier(s)))
    assert saved == pytest.approx(layers * per_pair * (s * s - pairs) / d, rel=1e-9)


def test_all_experts_in_the_model_states() -> None:
    cm = _cost_model("gpt-oss-120b", "h200x64")
    p, n = 116_789_050_944, 64
    # ZeRO-1: bf16 params and grads of every expert, fp32 master and moments sharded over 64.
    assert cm.model_state_bytes() == pytest.approx(2 * p + 2 * p + 12 * p / n)
    replicated = _cost_model("gpt-oss-120b", "h200x64", state_sharding="replicated")
    assert replicated.model_state_bytes() == pytest.approx(16 * p)


def test_expert_parallel_states_and_alltoall_by_hand() -> None:
    m = load_model("gpt-oss-120b")
    h, f_e, experts, layers, k = 2880, 2880, 128, 36, 4
    expert_params = layers * (experts * 3 * h * f_e + h * experts)
    p = num_params(m)
    ep = _cost_model("gpt-oss-120b", "h200x64", expert_parallel_size=8)
    local = p - expert_params + expert_params / 8
    assert ep.model_state_bytes() == pytest.approx(2 * local + 2 * local + 12 * p / 64)
    plain = _cost_model("gpt-oss-120b", "h200x64")
    s, d = 16384.0, 4
    extra = float(ep.sample_time_s(s, group_size=d)) - float(plain.sample_time_s(s, group_size=d))
    # per pass per MoE layer: dispatch and combine of k copies of h bf16 values a token, 7/8 sent,
    # at 0.7 x 450 GB/s inside a node; forward and backward: 2 passes a layer
    per_token_pass = 2 * 2 * k * h * 7 / 8 / (450e9 * 0.7)
    assert extra == pytest.approx(2 * layers * per_token_pass * s / d, rel=1e-9)
    # the step's gradient sync moves each rank's own gradients: D + X/8
    assert [c.bytes_per_rank for c in ep.grad_sync_calls()] == [2 * round(local)] * 2
    assert [c.bytes_per_rank for c in plain.grad_sync_calls()] == [2 * p] * 2
    fixed = ep.microbatch_fixed_s(group_size=d) - plain.microbatch_fixed_s(group_size=d)
    assert fixed == pytest.approx(layers * 2 * 2 * 10e-6, rel=1e-9)  # 2 all-to-alls x 2 passes, 10 us each


def test_expert_parallel_is_refused_where_the_experts_do_not_split() -> None:
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide num_gpus=64"):
        load_cluster("h200x64", expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size=64 must divide the experts of 'gpt-oss-20b' "
                                         r"\(num_experts=32\)"):
        _cost_model("gpt-oss-20b", "h200x64", expert_parallel_size=64)
    with pytest.raises(ValueError, match=r"must divide the experts of 'llama-7b' \(num_experts=0\)"):
        _cost_model("llama-7b", "h200x64", expert_parallel_size=8)


@pytest.mark.parametrize(("change", "field"), [
    ({"layer_types": ("full_attention",) * 3}, "layer_types has 3 entries but num_layers=24"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"num_experts_per_token": 33}, "num_experts_per_token=33 is above num_experts=32"),
    ({"dense_mlp_layers": (24,)}, "dense_mlp_layers=[24] must be distinct layers in 0..23"),
])
def test_bad_spec_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        ModelSpec(**{**load_model("gpt-oss-20b").model_dump(), **change})


def test_dense_models_dump_as_before() -> None:
    dumped = load_model("llama-7b").model_dump(mode="json")
    assert not {"num_experts", "layer_types", "sliding_window", "attention_sinks"} & set(dumped)
    assert "expert_parallel_size" not in load_cluster("h200x8").model_dump(mode="json")
