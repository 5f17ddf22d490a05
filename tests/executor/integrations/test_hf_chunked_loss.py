"""The chunked loss on an unmodified Hugging Face Llama (``hf_transformers.lm_token_losses``).

The same world of 4 and plans as ``test_hf_transformers.py``: the loss in chunks of 3 tokens
(fp64) must equal the plain model's step from its whole logits within 1e-10 relative (gradients,
the head's included) and 1e-12 on the loss; in chunks of 4 under FSDP2 (fp32), the plain model's
own loss within 1e-5. A model that soft-caps its logits is refused (the chunks do not cap).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from executor.integrations import hf_transformers as hf
from tests.executor.integrations import hf_llama


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_fp64_chunked_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    hf_llama.check_world_step(hf_world4, "llama64chunked", index, dtype=torch.float64, own_loss=False,
                              loss_rel=1e-12, grad_rel=1e-10)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_fsdp2_chunked_step_equals_the_plain_model_with_its_own_loss(hf_world4: list[dict[str, object]],
                                                                    index: int) -> None:
    hf_llama.check_world_step(hf_world4, "llama_fsdp2chunked", index, dtype=torch.float32, own_loss=True,
                              loss_rel=1e-5, grad_rel=1e-5)


def test_soft_capped_logits_and_negative_chunks_are_refused() -> None:
    from executor.context import SPContext
    from executor.layout import PackedLayout, SampleShape
    from executor.runtime import MicroBatchWork

    layout = PackedLayout(samples=(SampleShape(tokens=4, frames=1),), group_size=1, index_in_group=0)
    work = MicroBatchWork(index=0, ctx=SPContext(layout=layout, group=None), inputs=torch.zeros(4, dtype=torch.long),
                          targets=torch.zeros(4, dtype=torch.long), token_weights=torch.ones(4, dtype=torch.float64),
                          recompute_layers=(0,), sample_ids=("a",))
    model = hf_llama.build(hf.register(), dtype=torch.float64)
    with pytest.raises(ValueError, match="loss_chunk_tokens=-2 must be positive"):
        hf.lm_token_losses(model, work, loss_chunk_tokens=-2)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        hf.lm_token_losses(model, work, loss_chunk_tokens=2)
