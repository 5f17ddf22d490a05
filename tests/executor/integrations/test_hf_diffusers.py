"""DCP on an unmodified diffusers Latte (spatial + temporal attention) on 4 gloo ranks, fp64.

Plans of ``hf_latte.plans()`` (groups 2+1+1 with an idle rank, then 4; a sample and a whole
micro-batch shorter than the group; mixed per-sample policies; token and sample normalisation)
run through diffusers' attention-processor mechanism; the reference is the plain model (its own
processors) on each whole video in one process: gradients <= 1e-10 relative.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from executor.integrations import hf_diffusers
from tests.executor.integrations import hf_latte, hf_llama, video_steps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_fp64_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    plan = hf_latte.plans()[index]
    model = hf_latte.build()
    loss = hf_latte.reference_backward(model, plan)
    # The unused resolution embedder of AdaLN-single has an all-zero gradient on every rank too.
    checked = video_steps.assert_world_equals_reference(hf_world4, "latte", index, loss=loss,
                                                        reference=hf_llama.grads(model), tol=1e-10, loss_tol=1e-12)
    assert checked > 4 * 40  # most parameters have a gradient


def test_prepare_refuses_a_group_size_that_does_not_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=4 .* group sizes \[3\]"):
        hf_diffusers.prepare(hf_latte.build(), group_sizes=[1, 3])


def test_processors_need_the_dcp_forward() -> None:
    model = hf_diffusers.prepare(hf_latte.build(), group_sizes=[1])
    d = hf_latte.data("x", 1, 2, 2)
    with pytest.raises(ValueError, match="dcp_ctx"):
        model(hidden_states=d["video"][None], timestep=d["timestep"], encoder_hidden_states=d["caption"][None])
    assert torch.is_tensor(d["video"])
