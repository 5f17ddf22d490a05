"""DCP on an unmodified diffusers Wan 2.x (full 3D attention) on 4 gloo ranks.

Plans of ``hf_wan_model.plans()`` (groups 2+1+1 with an idle rank, then 4; clips and a whole
micro-batch shorter than the group; mixed per-sample policies; token and sample normalisation) run
through diffusers' attention-processor mechanism: Ulysses over each whole clip, the 3D rotary
embedding on each rank's own token positions, per-token modulation. The reference is the plain
model (its own processors and forward) on each whole clip in one process. Wan computes its norms
and block arithmetic in fp32 whatever the model's dtype (``FP32LayerNorm``, ``.float()`` in its
blocks), so the step equals the plain model's to fp32 rounding: the loss to 1e-10 relative, the
gradients to 1e-6 (the model in fp64 otherwise).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from executor.integrations import hf_wan
from tests.executor.integrations import hf_llama, hf_wan_model


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    plan = hf_wan_model.plans()[index]
    model = hf_wan_model.build()
    loss = hf_wan_model.reference_backward(model, plan)
    reference = hf_llama.grads(model)
    shares = [float(res[f"wan_loss_{index}"]) for res in hf_world4]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=1e-10)
    checked = 0
    for r, res in enumerate(hf_world4):
        grads = res[f"wan_grad_{index}"]
        assert isinstance(grads, dict)
        for name, want in reference.items():
            scale = float(want.abs().max())
            if scale == 0.0:
                assert float(grads[name].abs().max()) == 0.0, name
                continue
            rel = float((grads[name] - want).abs().max()) / scale
            assert rel <= 1e-6, f"rank {r}: {name} relative diff {rel:.2e}"
            checked += 1
    assert checked > 4 * 30  # most parameters have a gradient


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
