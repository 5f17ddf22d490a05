"""The analytic model against hand-computed FLOPs and bytes (llama-7b, stdit3-xl)."""

from __future__ import annotations

import pytest

from costmodel.analytic import (
    AnalyticConfig,
    activation_bytes_per_token_layer,
    analytic_cost_model,
    attention_flops_per_pair,
    linear_flops_per_token_layer,
    num_params,
)
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster, load_hardware, load_model
from costmodel.schema import CostModelFile

H200_PEAK = 989e12
CONSTANTS = AnalyticConfig(kernel_curves=False)
"""The constant efficiencies (what a hardware without published curves gets); the curves are
tests/costmodel/test_kernel_efficiency.py's."""


def test_llama7b_params_and_flops_by_hand() -> None:
    m = load_model("llama-7b")
    h, f, v, layers = 4096, 11008, 32000, 32
    # Public LLaMA-7B parameter count: 6,738,415,616.
    assert num_params(m) == layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h == 6_738_415_616
    assert linear_flops_per_token_layer(m) == 2 * (4 * h * h + 3 * h * f) == 404_750_336
    assert attention_flops_per_pair(m) == 2 * h  # causal: half of 4*h


def test_llama7b_bytes_by_hand() -> None:
    none, full = activation_bytes_per_token_layer(load_model("llama-7b"))
    h, f, heads = 4096, 11008, 32
    # LlamaDecoderLayer as counted (costmodel/presets/activation_bytes.json): each RMSNorm its fp32
    # input 4h, fp32 rsqrt 4, bf16 normalised 2h and the weighted output 2h; q, k, v, attention
    # output 2h each and lse 4*heads; SwiGLU MLP 4 x 2f
    assert none == 2 * (4 * h + 4 + 2 * h + 2 * h) + 2 * (4 * h) + 4 * heads + 8 * f == 186_504
    assert full == 2 * h


def test_llama7b_generic_formula_by_hand() -> None:
    """Without a family the formula of its kind: norm inputs in bf16, no fp32 copies [K22]."""
    none, full = activation_bytes_per_token_layer(load_model("llama-7b").model_copy(update={"family": None}))
    h, f, heads = 4096, 11008, 32
    # attention 2*(4h+2h) + lse 4*heads; SwiGLU MLP 2*(2h+4f)
    assert none == 2 * (6 * h) + 4 * heads + 2 * (2 * h + 4 * f) == 153_728
    assert full == 2 * h


def test_llama7b_times_by_hand() -> None:
    cm = CostModel(file=analytic_cost_model(load_model("llama-7b"), load_hardware("h200-sxm"), config=CONSTANTS),
                   cluster=load_cluster("h200x8"))
    s, layers = 8192, 32
    lin, attn = H200_PEAK * 0.6, H200_PEAK * 0.5
    # attention: pairs/d over the efficiency n/(n + 512) of n = s/d tokens per rank
    fwd = 404_750_336 * s / lin + 8192 * (s * s + 512 * s) / attn
    bwd = 2 * 404_750_336 * s / lin + 2.5 * 8192 * (s * s + 512 * s) / attn
    head = 4 * 2 * 4096 * 32000 * s / lin  # forward, backward 2x, and the chunked loss's recompute
    expected = layers * (fwd + bwd) + head
    assert float(cm.sample_time_s(s, group_size=1)) == pytest.approx(expected, rel=1e-12)
    # full checkpointing adds one forward per layer
    assert float(cm.sample_time_s(s, group_size=1, recompute_layers=layers)) == pytest.approx(
        expected + layers * fwd, rel=1e-12)
    # fixed part of a micro-batch: 1 ms, per layer call 14 kernels x 5 us forward (twice in
    # backward) and the dense parts' half-performance length 0.6*989e12 / (0.8*4.8e12) tokens
    half = 0.6 * 989e12 / (0.8 * 4.8e12)
    call_fwd = 70e-6 + 404_750_336 / lin * half
    call_bwd = 140e-6 + 2 * 404_750_336 / lin * half
    assert cm.microbatch_fixed_s(group_size=1) == pytest.approx(1e-3 + layers * (call_fwd + call_bwd))
    # full checkpointing: one recompute call per layer; mixed policies k=0 and k=32: every layer
    # runs twice (once per subset) in both passes
    assert cm.microbatch_fixed_s(group_size=1, recompute_layers=[32]) == pytest.approx(
        1e-3 + layers * (call_fwd + call_bwd) + layers * call_fwd)
    assert cm.microbatch_fixed_s(group_size=1, recompute_layers=[0, 32]) == pytest.approx(
        1e-3 + 2 * layers * (call_fwd + call_bwd) + layers * call_fwd)
    # d=2 inside a node: per-token compute halves, the attention efficiency term does not; the
    # executor's 2 all-to-alls per layer per pass (q,k,v fused; output) move 2*(2h+2h) bytes per
    # token, (d-1)/d of them sent, at 0.7 * 450 GB/s
    fwd2 = 404_750_336 * s / 2 / lin + 8192 * (s * s / 2 + 512 * s) / attn
    bwd2 = 2 * 404_750_336 * s / 2 / lin + 2.5 * 8192 * (s * s / 2 + 512 * s) / attn
    a2a_bytes = 2 * (2 * 4096 + 2 * 4096) * s / 2 * 0.5
    per_pass = a2a_bytes / (450e9 * 0.7)
    expected_d2 = layers * (fwd2 + bwd2) + head / 2 + 2 * layers * per_pass
    assert float(cm.sample_time_s(s, group_size=2)) == pytest.approx(expected_d2, rel=1e-12)
    assert cm.microbatch_fixed_s(group_size=2) == pytest.approx(
        1e-3 + layers * (call_fwd + call_bwd + 2 * 2 * 10e-6))


def test_stdit3_flops_and_bytes_by_hand() -> None:
    m = load_model("stdit3-xl")
    h, f, t = 1152, 4608, 300
    per_block_macs = 4 * h * h + 2 * h * h + 2 * h * f + 2 * t * h
    assert linear_flops_per_token_layer(m) == 2 * 2 * per_block_macs == 77_082_624
    assert attention_flops_per_pair(m) == 4 * h  # not causal
    none, full = activation_bytes_per_token_layer(m)
    lse = 4 * 16
    per_block = (2 * 6 * h + lse) + (2 * 3 * h + lse) + 2 * (2 * h + 2 * f) + 2 * 2 * h
    assert none == 2 * per_block == 97_024
    assert full == 2 * h


def test_stdit3_spatial_temporal_terms() -> None:
    cm = CostModel(file=analytic_cost_model(load_model("stdit3-xl"), load_hardware("h200-sxm"), config=CONSTANTS),
                   cluster=load_cluster("h200x8"))
    f, hw = 30, 15 * 26
    s = f * hw
    c = cm.file.compute
    rate_attn = H200_PEAK * 0.5
    assert c.forward.per_spatial_pair == pytest.approx(4 * 1152 / rate_attn)
    eff = 1 + 512 / s  # attention efficiency n/(n + 512) at n = s tokens per rank
    fwd = (c.forward.per_token * s + (c.forward.per_spatial_pair * f * hw * hw
           + c.forward.per_temporal_pair * hw * f * f) * eff + c.forward.per_sample)
    bwd = (c.backward.per_token * s + (c.backward.per_spatial_pair * f * hw * hw
           + c.backward.per_temporal_pair * hw * f * f) * eff + c.backward.per_sample)
    expected = 28 * (fwd + bwd) + c.head_s_per_token * s
    got = float(cm.sample_time_s(s, group_size=1, frames=f, spatial=hw))
    assert got == pytest.approx(expected, rel=1e-12)
    # the same tokens as one long frame cost more (spatial attention is quadratic in h*w)
    assert float(cm.sample_time_s(s, group_size=1, frames=1, spatial=s)) > got


def test_model_states_follow_sharding() -> None:
    p = 6_738_415_616
    for sharding, expected in [("replicated", 16 * p), ("zero1", 4 * p + 12 * p / 32)]:
        cluster = load_cluster("h200x32", state_sharding=sharding)
        cm = CostModel(file=analytic_cost_model(load_model("llama-7b"), cluster.hardware), cluster=cluster)
        assert cm.model_state_bytes() == pytest.approx(expected)


def test_sharded_gradients_are_refused_until_the_executor_runs_them() -> None:
    for sharding in ("zero2", "zero3"):
        cluster = load_cluster("h200x32", state_sharding=sharding)
        with pytest.raises(ValueError, match=f"state_sharding='{sharding}' is not what the executor runs"):
            CostModel(file=analytic_cost_model(load_model("llama-7b"), cluster.hardware), cluster=cluster)


def test_grad_sync_ring_over_network() -> None:
    grad_bytes = 6_738_415_616 * 2
    net = 50e9 * 0.8
    # ring all-reduce: 2*(N-1) latency steps, 2*(N-1)/N of the bytes; ZeRO-1 (the default) also
    # all-gathers the updated parameters: N-1 steps, (N-1)/N of the bytes
    allreduce = 2 * 31 * 30e-6 + 2 * 31 / 32 * grad_bytes / net
    allgather = 31 * 30e-6 + 31 / 32 * grad_bytes / net
    for sharding, expected in [("replicated", allreduce), ("zero1", allreduce + allgather)]:
        cluster = load_cluster("h200x32", state_sharding=sharding)
        cm = CostModel(file=analytic_cost_model(load_model("llama-7b"), cluster.hardware), cluster=cluster)
        assert cm.grad_sync_time_s() == pytest.approx(expected)


def test_cross_node_alltoall_is_slower() -> None:
    cluster = load_cluster("h200x32")
    cm = CostModel(file=analytic_cost_model(load_model("llama-7b"), cluster.hardware), cluster=cluster)
    inside = float(cm.alltoall_time_s(1e9, group_size=8))
    across = float(cm.alltoall_time_s(1e9, group_size=8, num_nodes=2))
    assert across > 2 * inside


def test_cost_model_file_round_trip(tmp_path) -> None:
    cmf = analytic_cost_model(load_model("stdit3-xl"), load_hardware("h100-sxm"))
    path = tmp_path / "cm.json"
    cmf.save(path)
    loaded = CostModelFile.load(path)
    assert loaded == cmf
    assert loaded.digest() == cmf.digest()
    assert cmf.id == "analytic-stdit3-xl-h100-sxm"


def test_cost_model_file_rejects_bad_version_and_bytes() -> None:
    data = analytic_cost_model(load_model("llama-7b"), load_hardware("h200-sxm")).model_dump()
    with pytest.raises(ValueError, match="schema_version=99 is not supported"):
        CostModelFile.model_validate({**data, "schema_version": 99})
    act = dict(data["activation"], bytes_per_token_layer_full=1e9)
    with pytest.raises(ValueError, match="bytes_per_token_layer_full=1000000000.0 exceeds"):
        CostModelFile.model_validate({**data, "activation": act})
