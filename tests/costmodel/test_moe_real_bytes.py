"""The MoE block's kept bytes per token (``costmodel.layer_mix.moe_block_bytes_per_token``) against
what the real transformers classes save for backward: Qwen3-MoE, gpt-oss and Mixtral blocks at
tiny widths in the real ratios of expert width to hidden size (Qwen3-30B-A3B 768/2048, gpt-oss
2880/2880, Mixtral 14336/4096), random weights, bf16 on the CPU.

Counted here, apart from the formula: a ``saved_tensors_hooks`` pair records every tensor autograd
saves while the block runs forward, each storage once, the parameters left out. Per token is the
difference between two sample lengths (what does not grow with the tokens cancels).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from costmodel.layer_mix import moe_block_bytes_per_token
from costmodel.specs import ModelSpec

HIDDEN = 64


def _saved_bytes(block: torch.nn.Module, tokens: int) -> int:
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().sum().backward()  # the saved tensors served a real backward
    return sum(storages.values())


CASES = {
    # name: (block class, config, spec fields: expert width, experts, per token, mlp)
    "qwen3-moe": (Qwen3MoeSparseMoeBlock,
                  Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=24, num_experts=16,
                                 num_experts_per_tok=4, norm_topk_prob=True),
                  (24, 16, 4, "swiglu")),
    "gpt-oss": (GptOssMLP,
                GptOssConfig(hidden_size=HIDDEN, intermediate_size=64, num_local_experts=8, num_experts_per_tok=4),
                (64, 8, 4, "swiglu_clamped")),
    "mixtral": (MixtralSparseMoeBlock,
                MixtralConfig(hidden_size=HIDDEN, intermediate_size=224, num_local_experts=8, num_experts_per_tok=2),
                (224, 8, 2, "swiglu")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_moe_block_bytes_match_the_real_class(name: str) -> None:
    torch.manual_seed(0)
    cls, config, (f_e, experts, k, mlp) = CASES[name]
    block = cls(config).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    short, long = _saved_bytes(block, 128), _saved_bytes(block, 384)
    measured = (long - short) / 256
    spec = ModelSpec(name=name, kind="1d", num_layers=1, hidden=HIDDEN, num_heads=4, ffn_hidden=f_e,
                     vocab=16, mlp=mlp, num_experts=experts, num_experts_per_token=k, expert_ffn_hidden=f_e)
    assert moe_block_bytes_per_token(spec) == pytest.approx(measured, rel=0.03)
