"""DCP on an unmodified Hugging Face Llama: a planned step on 4 gloo ranks equals the plain model.

The model is ``transformers``' own ``LlamaForCausalLM`` (small random config, grouped-query
attention), run under the plans of ``tests/executor/scenarios.py`` (groups 2+1+1, 4 and 1+2+1;
uneven shards; samples shorter than their group; several micro-batches; mixed per-sample
checkpoint policies; an idle rank; token and sample normalisation) through the attention plugin.
References: the plain model in one process on the whole padded batch, (a) with its own loss
(``labels=``, fp32: <= 1e-5 relative), (b) fp64 with the plan's normaliser from its logits
(<= 1e-10 relative); and the fp32 model under FSDP2 (``fully_shard`` per decoder layer and
root, :class:`executor.grad_sync.FSDP2Sync`) against (a).
"""

from __future__ import annotations

import pytest
import torch

from tests.executor import scenarios

pytest.importorskip("transformers")

from executor.integrations import hf_transformers as hf
from tests.executor.integrations import hf_llama


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_fp32_step_equals_the_plain_model_with_its_own_loss(hf_world4: list[dict[str, object]],
                                                           index: int) -> None:
    hf_llama.check_world_step(hf_world4, "llama32", index, dtype=torch.float32, own_loss=True,
                              loss_rel=1e-5, grad_rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1])
def test_fsdp2_step_equals_the_plain_model_with_its_own_loss(hf_world4: list[dict[str, object]],
                                                            index: int) -> None:
    hf_llama.check_world_step(hf_world4, "llama_fsdp2", index, dtype=torch.float32, own_loss=True,
                              loss_rel=1e-5, grad_rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_fp64_step_equals_the_plain_model(hf_world4: list[dict[str, object]], index: int) -> None:
    hf_llama.check_world_step(hf_world4, "llama64", index, dtype=torch.float64, own_loss=False,
                              loss_rel=1e-12, grad_rel=1e-10)


def test_prepare_refuses_a_group_size_the_heads_do_not_allow() -> None:
    model = hf_llama.build(hf.register(), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"group sizes \[3\] .*num_key_value_heads=4"):
        hf.prepare(model, group_sizes=[1, 2, 3, 4])


def test_prepare_refuses_another_attention() -> None:
    model = hf_llama.build("sdpa", dtype=torch.float32)
    with pytest.raises(ValueError, match="attn_implementation"):
        hf.prepare(model, group_sizes=[1])


def test_model_without_dcp_inputs_is_a_clear_error() -> None:
    model = hf_llama.build(hf.register(), dtype=torch.float32)
    hf.prepare(model, group_sizes=[1])
    with pytest.raises(ValueError, match="model_inputs"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_fp64_step_past_the_key_value_heads_equals_the_plain_model(hf_world4: list[dict[str, object]],
                                                                   index: int) -> None:
    """2 key/value heads, groups of 4: each rank of a 4-group gets the key/value head of its query
    heads, replicated; the step is still the plain model's."""
    plan = scenarios.plans_1d()[index]  # 2+1+1, 4 (past the 2 heads), 1+2+1
    assert index != 1 or [g.size for g in plan.groups] == [4]
    hf_llama.check_world_step(hf_world4, "llama_gqa", index, dtype=torch.float64, own_loss=False,
                              loss_rel=1e-12, grad_rel=1e-10, kv_heads=2)


def test_group_sizes_past_the_key_value_heads_are_allowed_when_they_divide() -> None:
    config = hf_llama.llama_config(kv_heads=2)
    hf.check_heads(config, group_sizes=[1, 2, 4, 8])  # 8 query heads, 2 KV heads: all fit
    with pytest.raises(ValueError, match=r"group sizes \[3\]"):
        hf.check_heads(config, group_sizes=[3])
    with pytest.raises(ValueError, match=r"group sizes \[16\]"):
        hf.check_heads(config, group_sizes=[16])  # past the query heads
