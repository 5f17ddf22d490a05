"""The profiled LLaMA layer keeps what the executor keeps past the key/value heads.

In a group of ``d`` ranks the executor gives each rank ``kv_heads / d`` key/value heads, or one
replicated head when ``d`` is past them (``executor/ulysses.py::qkv_seq_to_head``), and the cost
model charges one key/value head per rank there (``costmodel/model_terms.py``,
``kv_head_bytes_per_token_layer``). The profile's emulated group must keep the same.
"""

from __future__ import annotations

import torch

from costmodel.profiling.blocks import LlamaLayer
from costmodel.profiling.measure import SavedBytesCounter
from costmodel.specs import ModelSpec

HIDDEN, HEADS, SAMPLES = 64, 8, [(1, 32), (1, 16)]


def _kept_bytes(kv_heads: int, group_size: int) -> int:
    torch.manual_seed(0)
    spec = ModelSpec(name="gqa", kind="1d", num_layers=1, hidden=HIDDEN, num_heads=HEADS, num_kv_heads=kv_heads,
                     ffn_hidden=64, vocab=0, causal=True, mlp="swiglu")
    layer = LlamaLayer(spec).double()
    x = torch.randn(48 // group_size, HIDDEN, dtype=torch.float64, requires_grad=True)
    counter = SavedBytesCounter(exclude=[x, *layer.parameters()])
    with counter.recording():
        layer(x, SAMPLES, group_size).sum().backward()
    return counter.num_bytes


def test_past_the_key_value_heads_a_rank_keeps_one_replicated_head() -> None:
    d = 4
    one_head = _kept_bytes(4, d)  # 4 key/value heads over 4 ranks: one each, no replication
    assert _kept_bytes(2, d) == one_head  # 2 heads, each replicated to 2 ranks: still one each
    assert _kept_bytes(1, d) == one_head  # 1 head replicated to all 4
    # Multi-head (8 key/value heads): 2 heads per rank.
    assert _kept_bytes(HEADS, d) > one_head
