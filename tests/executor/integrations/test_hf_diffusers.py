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
from tests.executor.integrations import hf_latte, hf_llama


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_fp64_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    plan = hf_latte.plans()[index]
    model = hf_latte.build()
    loss = hf_latte.reference_backward(model, plan)
    reference = hf_llama.grads(model)
    shares = [float(res[f"latte_loss_{index}"]) for res in hf_world4]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=1e-12)
    checked = 0
    for r, res in enumerate(hf_world4):
        grads = res[f"latte_grad_{index}"]
        assert isinstance(grads, dict)
        for name, want in reference.items():
            scale = float(want.abs().max())
            if scale == 0.0:  # e.g. the unused resolution embedder of AdaLN-single
                assert float(grads[name].abs().max()) == 0.0, name
                continue
            rel = float((grads[name] - want).abs().max()) / scale
            assert rel <= 1e-10, f"rank {r}: {name} relative diff {rel:.2e}"
            checked += 1
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
