"""The chunked loss through the torchtitan integration (``torchtitan.lm_token_losses``), on the
test's torchtitan-shaped decoder (``titan_standin``; torchtitan itself needs a GPU): one process,
a packed micro-batch of three samples with mixed policies, fp64. The loss in chunks of 1, 3 and 64
tokens equals the whole-logits loss of the same forward within 1e-10, gradients of every parameter
too (the head's included); a head that is not linear is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from executor.context import SPContext
from executor.integrations import torchtitan as tt
from executor.layout import PackedLayout, SampleShape
from executor.runtime import MicroBatchWork
from tests.executor.integrations import titan_standin


def _work() -> MicroBatchWork:
    lengths = (7, 12, 5)
    layout = PackedLayout(samples=tuple(SampleShape(tokens=t, frames=1) for t in lengths), group_size=1,
                          index_in_group=0)
    gen = torch.Generator().manual_seed(3)
    tokens = sum(lengths)
    return MicroBatchWork(index=0, ctx=SPContext(layout=layout, group=None),
                          inputs=torch.randint(0, titan_standin.VOCAB, (tokens,), generator=gen),
                          targets=torch.randint(0, titan_standin.VOCAB, (tokens,), generator=gen),
                          token_weights=torch.rand(tokens, generator=gen, dtype=torch.float64),
                          recompute_layers=(0, titan_standin.LAYERS, 1), sample_ids=("a", "b", "c"))


def _step(chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = titan_standin.build()
    tt.install(model, group_sizes=[1])
    work = _work()
    loss = work.loss(tt.lm_token_losses(model, work, loss_chunk_tokens=chunk, head=model.lm_head))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunked_loss_equals_the_whole_logits_loss() -> None:
    whole_loss, whole = _step(0)
    assert "lm_head.weight" in whole
    for chunk in (1, 3, 64):
        loss, grads = _step(chunk)
        assert abs(float(loss - whole_loss)) <= 1e-10
        assert grads.keys() == whole.keys()
        for name, g in grads.items():
            assert float((g - whole[name]).abs().max()) <= 1e-10, (chunk, name)


def test_a_head_that_is_not_linear_is_refused() -> None:
    model = titan_standin.build()
    tt.install(model, group_sizes=[1])
    with pytest.raises(ValueError, match="not a linear layer"):
        tt.lm_token_losses(model, _work(), loss_chunk_tokens=4, head=nn.Identity())
