"""Each layer's own attention on one process (a group of one), against the plain model on each
sample alone: sliding windows shorter than the samples (Mistral, gpt-oss and Gemma 3's local
layers), gpt-oss's sinks, Gemma 3's scaling and norms, the experts of Qwen3-MoE, gpt-oss and
Mixtral; logits and every gradient in fp64. What DCP's attention does not do is refused by name:
logit soft-capping and non-causal attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from executor.context import SPContext
from executor.integrations import hf_layer_attention as layer_attention
from executor.integrations import hf_transformers as hf
from executor.layout import PackedLayout, SampleShape
from tests.executor.integrations import hf_moe_models

LENGTHS = (9, 3, 6)
TOL = 1e-10


def _ctx(ids: list[torch.Tensor]) -> SPContext:
    return SPContext(layout=PackedLayout(samples=tuple(SampleShape(tokens=len(t), frames=1) for t in ids),
                                         group_size=1, index_in_group=0), group=None)


def _dcp_logits(model: torch.nn.Module, ids: list[torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=torch.cat(ids)[None], position_ids=torch.cat([torch.arange(len(t)) for t in ids])[None],
                use_cache=False, **{hf.CTX_KWARG: _ctx(ids), hf.POLICY_KWARG: [1, 0, 2][:len(ids)], hf.PAD_KWARG: 0})
    return out.logits[0]


def _ids() -> list[torch.Tensor]:
    return [torch.randint(32, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]


def _loss_and_grads(model: Any, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    (logits * torch.linspace(-1.0, 1.0, logits.numel(), dtype=logits.dtype).view_as(logits)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", hf_moe_models.NAMES)
def test_each_layer_attention_equals_the_plain_model_on_one_process(name: str) -> None:
    ids = _ids()
    model = hf.prepare(hf_moe_models.build(name, hf.register(), dtype=torch.float64), group_sizes=[1])
    plain = hf_moe_models.build(name, hf_moe_models.reference_attention(name), dtype=torch.float64)
    want_logits = torch.cat([plain(input_ids=t[None], use_cache=False).logits[0] for t in ids])
    got_logits = _dcp_logits(model, ids)
    got, want = got_logits.detach(), want_logits.detach()
    assert float((got - want).abs().max()) <= TOL * float(want.abs().max())
    want_grads, got_grads = _loss_and_grads(plain, want_logits), _loss_and_grads(model, got_logits)
    assert set(got_grads) == set(want_grads)
    for key, ref in want_grads.items():
        bound = hf_moe_models.tolerance(name, key)
        assert float((got_grads[key] - ref).abs().max()) <= bound * float(ref.abs().max()), key


def test_the_window_and_the_sinks_change_the_plain_model() -> None:
    """The references above would not catch a missing window or sink: both change the logits."""
    t = torch.arange(9)[None] % 32
    for name, change in (("mistral_sw", {"sliding_window": 64}), ("gemma3", {"sliding_window": 64})):
        plain = hf_moe_models.build(name, "sdpa", dtype=torch.float64)
        cfg = hf_moe_models.config(name)
        for key, value in change.items():
            setattr(cfg, key, value)
        torch.manual_seed(0)
        wide = hf_moe_models.model_class(name)._from_config(cfg, attn_implementation="sdpa").to(torch.float64)
        assert not torch.allclose(plain(input_ids=t, use_cache=False).logits, wide(input_ids=t, use_cache=False).logits)
    gpt = hf_moe_models.build("gpt_oss", "eager", dtype=torch.float64)
    before = gpt(input_ids=t, use_cache=False).logits
    with torch.no_grad():
        for param_name, param in gpt.named_parameters():
            if param_name.endswith("self_attn.sinks"):
                param.fill_(-1e4)  # a sink that takes nothing
    assert not torch.allclose(before, gpt(input_ids=t, use_cache=False).logits)


def test_sinks_equal_the_softmax_with_one_more_column() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 4, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    pos = torch.arange(7)
    got = layer_attention.sample_attention(q, k, v, q_pos=pos, k_pos=pos, window=3, sinks=sinks, scale=0.7)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.7
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
    scores = scores.masked_fill(~seen, float("-inf"))
    probs = torch.softmax(torch.cat([scores, sinks.view(4, 1, 1).expand(4, 7, 1)], dim=-1), dim=-1)[..., :-1]
    want = torch.einsum("hqk,khd->qhd", probs, v)
    assert float((got - want).abs().max()) <= 1e-14


@pytest.mark.parametrize(("window", "sinks"), [(3, True), (None, True), (5, False)])
def test_query_blocks_equal_one_call_per_sample(window: int | None, sinks: bool) -> None:
    """Queries in blocks of 2 or 4 (each with the keys its window reaches) equal whole samples."""
    gen = torch.Generator().manual_seed(2)
    samples = (SampleShape(tokens=9), SampleShape(tokens=2), SampleShape(tokens=7))
    q = torch.randn(18, 4, 3, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(18, 2, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    sink = torch.randn(4, generator=gen, dtype=torch.float64) if sinks else None
    whole = layer_attention.packed_layer_attention(q, k, v, samples=samples, window=window, sinks=sink, scale=0.5,
                                                   block_tokens=64)
    for block in (2, 4):
        got = layer_attention.packed_layer_attention(q, k, v, samples=samples, window=window, sinks=sink,
                                                     scale=0.5, block_tokens=block)
        assert float((got - whole).abs().max()) <= 1e-14


def test_a_soft_capped_or_bidirectional_attention_is_refused_by_name() -> None:
    """Gemma 2 soft-caps its attention logits (Gemma 3 in this transformers does not pass its
    ``attn_logit_softcapping`` to the attention); Gemma 3 may attend both ways."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM

    ids = _ids()
    common = {k: v for k, v in hf_moe_models.config("mistral_sw").to_dict().items()
              if k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "intermediate_size")}
    capped = Gemma2ForCausalLM._from_config(Gemma2Config(**common, attn_logit_softcapping=50.0),
                                            attn_implementation=hf.register()).to(torch.float64)
    with pytest.raises(ValueError, match=r"Gemma2Attention: attention softcap=50.0 is not supported"):
        _dcp_logits(hf.prepare(capped, group_sizes=[1]), ids)
    cfg = hf_moe_models.config("gemma3")
    cfg.use_bidirectional_attention = True
    both = Gemma3ForCausalLM._from_config(cfg, attn_implementation=hf.register()).to(torch.float64)
    with pytest.raises(ValueError, match=r"Gemma3Attention: non-causal attention"):
        _dcp_logits(hf.prepare(both, group_sizes=[1]), ids)


def test_a_window_that_is_not_positive_is_refused_by_name() -> None:
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match=r"MistralAttention: sliding_window=.* must be a positive integer"):
            layer_attention.check_window(bad, where="MistralAttention")  # type: ignore[arg-type]
