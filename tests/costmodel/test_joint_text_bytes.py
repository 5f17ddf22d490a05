"""Joint (MMDiT) text tokens' kept activations in the cost model, against counts done by hand here.

Under Ulysses a sample's ``J`` joined text tokens are whole on every rank of its group (the
executor's scheme, ``executor/joint.py``), so each rank keeps their activations per layer like
``J`` more tokens that the group does not split: ``J`` x the per-token bytes of a kept layer, or of
a checkpointed layer's input, per sample and layer.
"""

from __future__ import annotations

import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster, load_hardware
from costmodel.specs import ModelSpec

# A tiny MMDiT: h = 8, 2 heads of 4, MLP 16, 5 text tokens joined to every block, 2 layers.
MMDIT = ModelSpec(name="tiny-mmdit", kind="3d", num_layers=2, hidden=8, num_heads=2, ffn_hidden=16, causal=False,
                  joint_attention_tokens=5, dual_stream_layers=1, patch_size=(1, 2, 2), latent_channels=4)
# Kept bytes per token and layer, bf16: self-attention norm input, qkv input, q, k, v, output
# 6 x 16 = 96 and the fp32 log-sum-exp per head 8; MLP norm input and input 2 x 16, fc1 output and
# its GELU 2 x 32; the two modulated inputs 2 x 16: 104 + 96 + 32 = 232. A checkpointed layer keeps
# its input, 16.
NONE_BYTES, FULL_BYTES = 232, 16
# Per sample, 5 text tokens: no checkpointing, 2 kept layers 5 x 2 x 232 = 2,320; one of two layers
# recomputed, 1 kept + 1 input 5 x (232 + 16) = 1,240; both recomputed, the last one rematerialised
# in backward on top of both inputs 5 x (232 + 2 x 16) = 1,320.
TEXT_BYTES = {0: 2320, 1: 1240, 2: 1320}


def _models() -> tuple[CostModel, CostModel]:
    hardware, cluster = load_hardware("h200-sxm"), load_cluster("h200x64")
    joint = CostModel(file=analytic_cost_model(MMDIT, hardware), cluster=cluster)
    no_text = MMDIT.model_copy(update={"joint_attention_tokens": 0, "dual_stream_layers": 0})
    bare = CostModel(file=joint.file.model_copy(update={"model": no_text}), cluster=cluster)
    return joint, bare


def test_the_files_per_token_bytes_are_the_hand_count() -> None:
    joint, _ = _models()
    assert joint.file.activation.bytes_per_token_layer_none == NONE_BYTES
    assert joint.file.activation.bytes_per_token_layer_full == FULL_BYTES


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("group_size", [1, 2])
def test_each_sample_keeps_its_text_tokens_whole_on_every_rank(k: int, group_size: int) -> None:
    joint, bare = _models()
    for tokens in (4, 40, 400):
        extra = float(joint.activation_bytes(tokens, group_size=group_size, recompute_layers=k)) - float(
            bare.activation_bytes(tokens, group_size=group_size, recompute_layers=k))
        assert extra == pytest.approx(TEXT_BYTES[k], rel=1e-12)  # per sample, not split by the group
    # Additive per sample: three samples of a micro-batch keep three samples' text.
    both = joint.activation_bytes([4, 40, 400], group_size=group_size, recompute_layers=[k, k, k])
    plain = bare.activation_bytes([4, 40, 400], group_size=group_size, recompute_layers=[k, k, k])
    assert float((both - plain).sum()) == pytest.approx(3 * TEXT_BYTES[k], rel=1e-12)


def test_a_cross_attention_model_keeps_no_text_rows() -> None:
    wan = MMDIT.model_copy(update={"joint_attention_tokens": 0, "dual_stream_layers": 0, "cross_attention_tokens": 3})
    cm = CostModel(file=analytic_cost_model(wan, load_hardware("h200-sxm")), cluster=load_cluster("h200x64"))
    a = cm.file.activation
    per_token = (2 * a.bytes_per_token_layer_none + a.working_bytes_per_token + a.alltoall_buffer_bytes_per_token
                 + max(a.transient_bytes_per_token, a.head_transient_bytes_per_token))
    assert float(cm.activation_bytes(40, group_size=2)) == pytest.approx(40 / 2 * per_token, rel=1e-12)


def test_megatron_dyncp_sizes_ranks_by_the_bytes_per_token_not_per_sample() -> None:
    from costmodel.specs import Sample
    from planner.baselines.megatron_dyncp import max_tokens_per_rank
    from planner.costs import CostTable

    joint, _ = _models()
    samples = [Sample(id=f"c{i}", tokens=16 * (i + 1), frames=i + 1, height=4, width=4) for i in range(3)]
    table = CostTable(joint, samples, sizes=[1, 2])
    a = joint.file.activation
    # One more token on one rank: 2 kept layers of 232 bytes, working and backward buffers.
    per_token = 2 * NONE_BYTES + a.working_bytes_per_token + max(a.transient_bytes_per_token,
                                                                 a.head_transient_bytes_per_token)
    assert max_tokens_per_rank(table) == int(table.budget_bytes // per_token)
