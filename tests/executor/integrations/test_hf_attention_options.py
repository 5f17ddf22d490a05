"""What a transformers model asks of its attention that DCP's does not do is refused, not
ignored: a Mistral sliding window shorter than a sample would otherwise attend over keys the
model masks. One process (a group of one): the plain model is Mistral with its own ``sdpa``
attention on each sample alone.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from executor.context import SPContext
from executor.integrations import hf_transformers as hf
from executor.layout import PackedLayout, SampleShape

LENGTHS = (6, 3)


def _mistral(attn_implementation: str, window: int) -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           sliding_window=window)
    return MistralForCausalLM._from_config(config, attn_implementation=attn_implementation).to(torch.float64)


def _dcp_logits(model: torch.nn.Module, ids: list[torch.Tensor]) -> torch.Tensor:
    ctx = SPContext(layout=PackedLayout(samples=tuple(SampleShape(tokens=len(t), frames=1) for t in ids),
                                        group_size=1, index_in_group=0), group=None)
    out = model(input_ids=torch.cat(ids)[None], position_ids=torch.cat([torch.arange(len(t)) for t in ids])[None],
                use_cache=False, **{hf.CTX_KWARG: ctx, hf.POLICY_KWARG: [0] * len(ids), hf.PAD_KWARG: 0})
    return out.logits[0]


def test_a_window_no_sample_outgrows_runs_and_equals_the_plain_model() -> None:
    ids = [torch.randint(32, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    model = hf.prepare(_mistral(hf.register(), window=max(LENGTHS)), group_sizes=[1])
    plain = _mistral("sdpa", window=max(LENGTHS))
    with torch.no_grad():
        want = torch.cat([plain(input_ids=t[None], use_cache=False).logits[0] for t in ids])
        got = _dcp_logits(model, ids)
    assert float((got - want).abs().max()) <= 1e-10 * float(want.abs().max())


def test_a_window_shorter_than_a_sample_is_refused_by_name() -> None:
    ids = [torch.zeros(n, dtype=torch.long) for n in LENGTHS]
    model = hf.prepare(_mistral(hf.register(), window=4), group_sizes=[1])
    with pytest.raises(ValueError, match=r"MistralAttention: sliding_window=4 is shorter than a sample of 6 tokens"):
        _dcp_logits(model, ids)
    # The plain model does mask there: a window of 4 changes the 6-token sample's last logits.
    short, full = _mistral("sdpa", window=4), _mistral("sdpa", window=6)
    t = torch.arange(6)[None]
    assert not torch.allclose(short(input_ids=t, use_cache=False).logits, full(input_ids=t, use_cache=False).logits)
