"""The ring's default coefficients against the published measurements they come from
(docs/cost-model.md): ring-flash-attn's zig-zag table, and the in-node and cross-node orderings
of Ulysses, ring and hybrid layouts (USP, Fang & Zhao 2024) for Llama-3.1-8B and Wan2.1-14B."""

from __future__ import annotations

import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster, load_hardware, load_model
from costmodel.ring import default_p2p_links, kv_bytes_per_token, ring_attention_time_s
from costmodel.specs import Sample


def test_defaults_reproduce_ring_flash_attn_zigzag_table() -> None:
    """ring-flash-attn README: zig-zag ring on 8xH800, Llama-3.1-8B attention, 8k tokens per GPU,
    batch api: 85.2% (forward) and 90.2% (forward + backward) of flash attention's time on the
    same pairs. An H800 is an H100's compute with 400 GB/s NVLink (200 per direction)."""
    model = load_model("llama-3.1-8b")
    hw = load_hardware("h100-sxm").model_copy(update={"nvlink_bytes_per_s_per_direction": 200e9})
    c = analytic_cost_model(model, hw).compute
    curves = c.attention_efficiency
    assert curves is not None
    r = 8

    def blocks(s):  # type: ignore[no-untyped-def]  # the benchmark's baseline runs 8k-token kernels too
        return curves.forward.time_multiplier(s / r), curves.backward.time_multiplier(s / r)

    fwd, bwd, exp_f, exp_b = ring_attention_time_s(
        [8192 * r], ulysses_degree=1, ring_degree=r, forward_s_per_pair=c.forward.per_attn_pair,
        backward_s_per_pair=c.backward.per_attn_pair, kv_bytes_per_token=kv_bytes_per_token(model, ulysses_degree=1),
        query_channels=model.num_heads * model.head_size, links=default_p2p_links(hw), crosses_nodes=False,
        hbm_bytes_per_s=hw.hbm_bandwidth_bytes_per_s, block_multipliers=blocks, charged_multipliers=blocks)
    assert (fwd - exp_f) / fwd == pytest.approx(0.852, abs=0.02)
    assert (fwd - exp_f + bwd - exp_b) / (fwd + bwd) == pytest.approx(0.902, abs=0.02)


def _one_sample_s(cm: CostModel, sample: Sample, *, d: int, r: int) -> float:
    layout = cm.place(first_rank=0, group_size=d, ring_degree=r)
    return cm.microbatch_time_s([sample], group_size=d, recompute_layers=[cm.num_layers], layout=layout)


def _sample(model: str, tokens: int) -> Sample:
    if model == "wan2.1-14b":  # a clip of 32 x 32 patches per frame
        return Sample(id="clip", frames=tokens // 1024, height=32, width=32)
    return Sample(id="text", tokens=tokens)


@pytest.mark.parametrize("cluster", ["h200x8", "h100x16"])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "wan2.1-14b"])
def test_ulysses_beats_every_ring_inside_a_node(cluster: str, model: str) -> None:
    spec = load_cluster(cluster)
    cm = CostModel(file=default_cost_model_file(model, spec.hardware.name), cluster=spec)
    for tokens in (32768, 65536, 131072):
        sample = _sample(model, tokens)
        ulysses = _one_sample_s(cm, sample, d=8, r=1)
        for r in (2, 4, 8):
            assert ulysses < _one_sample_s(cm, sample, d=8, r=r), (model, tokens, r)


def test_the_node_wide_hybrid_wins_across_nodes() -> None:
    """Across nodes: Ulysses over the 8 GPUs of a node x a ring over the nodes beats pure Ulysses and
    pure ring where Ulysses can still run (Llama-3.1-8B, 16 and 32 GPUs), and beats the pure ring
    past the query heads, where pure Ulysses cannot (64 GPUs for Llama's 32 heads, 80 for Wan's 40)."""
    spec = load_cluster("h200x128")
    llama = CostModel(file=default_cost_model_file("llama-3.1-8b", spec.hardware.name), cluster=spec)
    wan = CostModel(file=default_cost_model_file("wan2.1-14b", spec.hardware.name), cluster=spec)
    for tokens in (65536, 131072):
        text = _sample("llama-3.1-8b", tokens)
        for d in (16, 32):
            hybrid = _one_sample_s(llama, text, d=d, r=d // 8)
            assert hybrid < _one_sample_s(llama, text, d=d, r=1) and hybrid < _one_sample_s(llama, text, d=d, r=d)
        for cm, sample, d in ((llama, text, 64), (wan, _sample("wan2.1-14b", tokens), 80)):
            assert d not in cm.file.model.allowed_group_sizes(max_size=d)  # past the query heads
            assert _one_sample_s(cm, sample, d=d, r=d // 8) < _one_sample_s(cm, sample, d=d, r=d)
