"""DCP on an unmodified diffusers HunyuanVideo (MMDiT-style joint text attention) on 4 gloo ranks.

The plans of ``hf_wan_model.plans()`` (groups 2+1+1 with an idle rank, then 4 with a micro-batch
shorter than the group; mixed per-sample policies over the 3 blocks; token and sample
normalisation) run through :func:`executor.integrations.hf_hunyuan.forward`: Ulysses over each whole
clip, every sample's text tokens whole on every rank of its group (masked text keys dropped,
as the model masks them), per-token modulation, per-sample checkpointing that takes a sample's text
rows with it. The reference is the plain model (its own forward with its attention mask) on each
whole clip in one process, fp64: loss and gradients within 1e-10 relative.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from executor.integrations import hf_hunyuan
from tests.executor.integrations import hf_hunyuan_model, hf_wan_model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    checked = hf_hunyuan_model.assert_world_equals_plain(hf_world4, hf_wan_model.plans()[index], index, tol=1e-10)
    assert checked > 4 * 90  # 106 parameters on 4 ranks; only numerically-zero gradients are not relative


def test_prepare_refuses_a_group_size_that_does_not_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by group sizes \[3\]"):
        hf_hunyuan.prepare(hf_hunyuan_model.build(), group_sizes=[1, 3])


def test_prepare_refuses_another_model_and_image_conditioning() -> None:
    with pytest.raises(ValueError, match="HunyuanVideoTransformer3DModel"):
        hf_hunyuan.prepare(hf_wan_model.build(), group_sizes=[1])
    model = hf_hunyuan_model.build()
    model.register_to_config(image_condition_type="token_replace")
    with pytest.raises(ValueError, match="image_condition_type='token_replace'"):
        hf_hunyuan.prepare(model, group_sizes=[1])


def test_patchify_is_the_models_unpatchify_inverse() -> None:
    video = torch.randn(4, 3, 4, 6, dtype=torch.float64)
    tokens = hf_hunyuan.patchify(video, (1, 2, 2))
    # The model's unpatchify (transformer_hunyuan_video.py): (f, h, w, C, p_t, p_h, p_w) -> (C, F, H, W).
    back = tokens.reshape(1, 3, 2, 3, 4, 1, 2, 2).permute(0, 4, 1, 5, 2, 6, 3, 7)
    back = back.flatten(6, 7).flatten(4, 5).flatten(2, 3)
    assert torch.equal(back[0], video)


def test_inputs_that_do_not_match_the_micro_batch_are_named() -> None:
    from executor.context import SPContext
    from executor.layout import PackedLayout, SampleShape
    from executor.runtime import MicroBatchWork

    model = hf_hunyuan.prepare(hf_hunyuan_model.build(), group_sizes=[1])
    d = hf_hunyuan_model.data("x", 1, 2, 2)
    ctx = SPContext(layout=PackedLayout(samples=(SampleShape(tokens=4, frames=1),), group_size=1, index_in_group=0),
                    group=None)
    work = MicroBatchWork(index=0, ctx=ctx, inputs=d["video"], targets=d["target"], token_weights=torch.ones(4),
                          recompute_layers=(0,), sample_ids=("x",))
    with pytest.raises(ValueError, match=r"1 samples; got \{'texts': 2\}"):
        hf_hunyuan.forward(model, work, videos=[d["video"]], timesteps=d["timestep"],
                           texts=d["text"][None].repeat(2, 1, 1), text_masks=d["mask"][None],
                           pooled=d["pooled"][None], guidance=d["guidance"])
