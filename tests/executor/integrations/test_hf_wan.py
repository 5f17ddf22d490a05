"""DCP on an unmodified diffusers Wan 2.x (full 3D attention) on 4 gloo ranks.

Plans of ``hf_wan_model.plans()`` (groups 2+1+1 with an idle rank, then 4; clips and a whole
micro-batch shorter than the group; mixed per-sample policies; token and sample normalisation) run
through diffusers' attention-processor mechanism: Ulysses over each whole clip, the 3D rotary
embedding on each rank's own token positions, per-token modulation. The reference is the plain
model (its own processors and forward) on each whole clip in one process, fp64. Wan computes its
norms and modulation in fp32 whatever the model's dtype (``FP32LayerNorm``, ``.float()`` in its
blocks): the forward values still agree (loss <= 1e-10 relative; 0 and 3.5e-16 measured), and so do
the gradients of every parameter (<= 1e-10; 4.6e-15 measured) but those whose gradient is reduced
or rounded in fp32 on each rank before the ranks' sum: the time embedding (``time_embedder``,
``time_proj``, which feeds ``temb.float()`` in every block) and the affine fp32 norms (``norm2``),
<= 1e-6 (7.1e-8 measured, fp32 rounding).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from executor.integrations import hf_wan
from tests.executor.integrations import hf_wan_model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    hf_wan_model.assert_world_equals_plain(hf_world4, hf_wan_model.plans()[index], index, tol=1e-10)


def test_prepare_refuses_a_group_size_that_does_not_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by group sizes \[3\]"):
        hf_wan.prepare(hf_wan_model.build(), group_sizes=[1, 3])


def test_processors_need_the_dcp_forward() -> None:
    model = hf_wan.prepare(hf_wan_model.build(), group_sizes=[1])
    d = hf_wan_model.data("x", 1, 2, 2)
    with pytest.raises(ValueError, match="hf_wan.forward"):
        model(hidden_states=d["video"][None], timestep=d["timestep"], encoder_hidden_states=d["text"][None])


def test_patchify_is_the_models_unpatchify_inverse() -> None:
    video = torch.randn(4, 3, 4, 6, dtype=torch.float64)
    tokens = hf_wan.patchify(video, (1, 2, 2))
    # The model's unpatchify (transformer_wan.py): (f, h, w, p_t, p_h, p_w, C) -> (C, F, H, W).
    back = tokens.reshape(1, 3, 2, 3, 1, 2, 2, 4).permute(0, 7, 1, 4, 2, 5, 3, 6)
    back = back.flatten(6, 7).flatten(4, 5).flatten(2, 3)
    assert torch.equal(back[0], video)
