"""The 3d kind and GQA past the key/value heads against counts done by hand here (not through the
functions under test): parameters, FLOPs, activation and all-to-all bytes, and what the cost model
makes of them (quadratic in a clip's tokens, text terms per sample, replicated heads)."""

from __future__ import annotations

import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.model_terms import (
    activation_bytes_per_token_layer,
    alltoall_bytes_per_token_layer,
    attention_flops_per_pair,
    kv_head_bytes_per_token_layer,
    linear_flops_per_token_layer,
    num_params,
)
from costmodel.presets import load_cluster, load_hardware, load_model
from costmodel.specs import ModelSpec

# A tiny Wan-style block: h = 8, 2 heads of 4, MLP 16, 3 text tokens (cross-attention), 2 layers.
WAN = ModelSpec(name="tiny-wan", kind="3d", num_layers=2, hidden=8, num_heads=2, ffn_hidden=16, causal=False,
                cross_attention_tokens=3, patch_size=(1, 2, 2), latent_channels=4)
# A tiny MMDiT: the same block with 5 text tokens joined, 1 of its 2 layers dual-stream.
MMDIT = ModelSpec(name="tiny-mmdit", kind="3d", num_layers=2, hidden=8, num_heads=2, ffn_hidden=16, causal=False,
                  joint_attention_tokens=5, dual_stream_layers=1, patch_size=(1, 2, 2), latent_channels=4)


def test_wan_block_by_hand() -> None:
    # Parameters per block: q, k, v, o 4*64 = 256; cross-attention 4*64 = 256; MLP 2*8*16 = 256;
    # norms and modulation vectors 6*8 = 48: 816. Patch embedding in and out: 2 * (4*1*2*2) * 8 = 256.
    assert num_params(WAN) == 2 * 816 + 256
    # Forward FLOPs per token and layer: 2 x (qkvo 256 + cross q, o 128 + scores 2*3*8 = 48 + MLP 256).
    assert linear_flops_per_token_layer(WAN) == 2 * (256 + 128 + 48 + 256)
    # A (query, key) pair of the whole-clip attention: QK^T and PV, 2 x 2 x 8, not causal.
    assert attention_flops_per_pair(WAN) == 32
    # Kept bytes per token and layer, bf16 (2 bytes a value): self-attention norm input, qkv input,
    # q, k, v, output 6 x 16 = 96 and the fp32 log-sum-exp per head 8; cross-attention q input, q,
    # output 48 + 8; MLP norm input and input 2 x 16 = 32, fc1 output and its GELU 2 x 32 = 64;
    # the two modulated inputs 2 x 16 = 32.
    none, full = activation_bytes_per_token_layer(WAN)
    assert none == (96 + 8) + (48 + 8) + (32 + 64) + 32
    assert full == 16
    # All-to-alls: q, k, v in, output out (2 x 8 + 2 x 8 values x 2 bytes), 2 operations.
    assert alltoall_bytes_per_token_layer(WAN) == (64.0, 2)


def test_mmdit_block_by_hand() -> None:
    # A stream: qkvo 256 + MLP 256 + adaLN-Zero modulation 6*64 = 384 + norms 4*8 = 32: 928; layer 1
    # has a second (text) stream: 3 streams in all, plus the patch embeddings 256.
    assert num_params(MMDIT) == 3 * 928 + 256
    # Per video token: qkvo 256, MLP 256, and its 2*J = 10 pairs with the joined text tokens at
    # 2*inner = 16 MACs a pair (QK^T and PV, 8 each): 160.
    assert linear_flops_per_token_layer(MMDIT) == 2 * (256 + 256 + 160)


def test_text_patching_and_working_set_by_hand() -> None:
    """Per-sample text terms, the patch (un)embedding and the working set of the tiny blocks,
    read through the analytic file (seconds x the assumed rate back to FLOPs)."""
    hardware = load_hardware("h200-sxm")
    # the analytic default's dense efficiency on H200: the best published H100 GEMM point, 783.33 of
    # 989 TFLOP/s (docs/cost-model.md)
    rate = hardware.bf16_dense_flops * 783.33 / 989
    # Wan: the k, v projections of the 3 text tokens per sample and layer: 2 x 3 x 8 x 8 MACs = 384,
    # 768 FLOPs. MMDiT: the text stream on 5 tokens, qkvo 256 + MLP 256 MACs a token: 2 x 5 x 512
    # = 5,120 FLOPs, and the 5 x 5 text-text pairs of the joined attention at 4 x 8: 800.
    for model, per_sample in ((WAN, 768), (MMDIT, 5120 + 800)):
        fwd = analytic_cost_model(model, hardware).compute.forward
        assert fwd.per_sample * rate == pytest.approx(per_sample)
    # Patch embedding in and un-patching out, 4 channels x 1x2x2 = 16 latent values to h = 8 and
    # back: 2 x 16 x 8 MACs a token forward, 3x with backward, 2 FLOPs a MAC: 1,536 FLOPs.
    cm = analytic_cost_model(WAN, hardware)
    assert cm.compute.head_s_per_token * rate == pytest.approx(1536)
    # Working set per token: the last block's input and output (2 x 8) and, in Ulysses groups of
    # more than one rank, the send and receive buffers of q, k, v (2 x 3 x 8 values), 2 bytes a
    # value: 32 + 96.
    assert cm.activation.working_bytes_per_token == 32
    assert cm.activation.alltoall_buffer_bytes_per_token == 96
    # Backward transient per token: the GELU MLP's two 16-wide gradients (2 x 16 x 2 bytes = 64)
    # and fp32 q, k, v gradient accumulators (3 x 8 x 4 = 96).
    assert cm.activation.transient_bytes_per_token == 64 + 96


def test_a_clips_cost_is_quadratic_and_its_text_per_sample() -> None:
    hardware = load_hardware("h200-sxm")
    cluster = load_cluster("h200x64")
    cm = CostModel(file=analytic_cost_model(load_model("wan2.1-14b"), hardware), cluster=cluster)
    one = float(cm.sample_time_s(21 * 45 * 80, group_size=8, frames=21, spatial=45 * 80))
    two = float(cm.sample_time_s(42 * 45 * 80, group_size=8, frames=42, spatial=45 * 80))
    assert two > 2.2 * one  # whole-clip attention: twice the tokens cost more than twice
    fwd = cm.file.compute.forward
    h, t = 5120, 512
    # Cross-attention's k, v projections of the 512 text tokens per sample and layer: 2*T*h^2 MACs.
    rate = hardware.bf16_dense_flops * 783.33 / 989
    assert fwd.per_sample == pytest.approx(2 * 2 * t * h * h / rate)
    assert fwd.per_spatial_pair == 0 and fwd.per_temporal_pair == 0 and fwd.per_attn_pair > 0


def test_hunyuanvideo_counts_near_its_published_size() -> None:
    assert 12.5e9 < num_params(load_model("hunyuanvideo-13b")) < 14e9  # "13B" (Kong et al. 2024)
    assert 13.5e9 < num_params(load_model("wan2.1-14b")) < 14.5e9
    assert 1.2e9 < num_params(load_model("wan2.1-1.3b")) < 1.5e9


def test_gqa_groups_past_the_kv_heads_pay_replicated_heads() -> None:
    model = load_model("llama-3.1-8b")  # 32 query heads, 8 KV heads of 128
    assert model.kv_heads == 8 and model.head_size == 128
    # One head's k and v per token: 2 x 128 values x 2 bytes.
    assert kv_head_bytes_per_token_layer(model) == 512
    cm = CostModel(file=analytic_cost_model(model, load_hardware("h200-sxm")), cluster=load_cluster("h200x64"))
    a = cm.file.activation
    tokens = 131072
    for d in (4, 8, 16, 32):
        extra_heads = max(0, d - 8)
        plain = tokens / d * (32 * a.bytes_per_token_layer_none + a.working_bytes_per_token
                              + a.alltoall_buffer_bytes_per_token
                              + max(a.transient_bytes_per_token, a.head_transient_bytes_per_token))
        assert float(cm.activation_bytes(tokens, group_size=d)) == pytest.approx(
            plain + tokens / d * 32 * 512 * extra_heads)
    # Past 8 ranks the all-to-all moves each token's k and v to d ranks: more bytes than without.
    bare = CostModel(file=cm.file.model_copy(update={"comm": cm.file.comm.model_copy(
        update={"alltoall_kv_head_bytes_per_token_layer": 0.0})}), cluster=cm.cluster)
    assert float(cm.sample_time_s(tokens, group_size=8)) == float(bare.sample_time_s(tokens, group_size=8))
    assert float(cm.sample_time_s(tokens, group_size=32)) > float(bare.sample_time_s(tokens, group_size=32))


def test_a_version_1_file_reads_two_all_to_alls_per_attention_of_its_kind() -> None:
    """Version-1 files counted 4 all-to-alls per attention; read back, each kind has 2 per
    self-attention its layer runs (2d: spatial and temporal, 4; 1d and 3d: one attention, 2)."""
    from costmodel.schema import CostModelFile

    hardware = load_hardware("h200-sxm")
    for name, ops in (("llama-7b", 2), ("stdit3-xl", 4), ("wan2.1-14b", 2)):
        data = analytic_cost_model(load_model(name), hardware).model_dump(mode="json")
        data["schema_version"] = 1
        data["comm"]["alltoall_ops_per_layer"] = 99
        old = CostModelFile.model_validate(data)
        assert old.comm.alltoall_ops_per_layer == ops, name
        assert "upgraded from schema_version 1" in old.notes
