"""DCPTrainer's argument checks and its default evaluation collator (one process, no torch.distributed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from executor.integrations.hf_trainer import DCPTrainer
from executor.integrations.hf_trainer_eval import CausalLMPadding, eval_attention_of


class _NoPlans:
    num_steps = 1

    def get(self, step: int) -> None:
        raise AssertionError("no plan is fetched before the arguments are checked")


def test_gradient_accumulation_is_refused_with_the_reason(tmp_path: object) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=4, use_cpu=True, report_to=[])
    with pytest.raises(ValueError) as err:
        DCPTrainer(model=None, args=args, plans=_NoPlans())
    message = str(err.value)
    assert "gradient_accumulation_steps=4" in message
    assert "plan's micro-batches are the accumulation" in message
    assert "samples_per_step" in message and "set gradient_accumulation_steps=1" in message.lower()


def test_eval_attention_defaults_to_the_models_own_and_refuses_dcps() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager")
    assert eval_attention_of(model, requested=None) == "eager"
    assert eval_attention_of(model, requested="sdpa") == "sdpa"
    with pytest.raises(ValueError, match="eval_attention='dcp_ulysses'"):
        eval_attention_of(model, requested="dcp_ulysses")


def test_causal_lm_padding_pads_right_and_keeps_given_labels() -> None:
    batch = CausalLMPadding(pad_token_id=7)([{"input_ids": [1, 2, 3]},
                                             {"input_ids": [4, 5], "labels": [-100, 5]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 7]]
    assert batch["labels"].tolist() == [[1, 2, 3], [-100, 5, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["input_ids"].dtype == torch.long
    with pytest.raises(ValueError, match="evaluation row 0: 2 input_ids and 1 labels"):
        CausalLMPadding()([{"input_ids": [1, 2], "labels": [3]}])
