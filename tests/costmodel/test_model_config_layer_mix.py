"""``--model-config`` on mixture-of-experts and windowed configs: the public configs give the
presets, and each family's layer types and MoE layers follow transformers' own config classes
(built here with transformers 5.24 and compared layer by layer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import Gemma3TextConfig, GptOssConfig, MistralConfig, Qwen2Config, Qwen3MoeConfig

from costmodel.model_config import model_spec_from_config
from costmodel.presets import load_model

CONFIGS = Path(__file__).resolve().parents[2] / "costmodel" / "presets" / "model_configs"


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b"])
def test_public_configs_give_the_presets(name: str) -> None:
    spec = model_spec_from_config(CONFIGS / f"{name}.json")
    assert spec.name == name
    assert spec.shape_differences(load_model(name)) == []


def _ours(config: Any) -> tuple[tuple[str, ...] | None, int | None]:
    data = {k: v for k, v in config.to_dict().items() if k != "layer_types"}  # derived, as a bare config.json
    spec = model_spec_from_config({**data, "vocab_size": data.get("vocab_size") or 64})
    return spec.layer_types, spec.sliding_window


TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 128, "head_dim": 16}


@pytest.mark.parametrize("config", [
    Gemma3TextConfig(**TINY, num_hidden_layers=13, sliding_window=32, sliding_window_pattern=6),
    GptOssConfig(**TINY, num_hidden_layers=5, sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    Qwen2Config(**TINY, num_hidden_layers=6, use_sliding_window=True, sliding_window=16, max_window_layers=4),
], ids=["gemma3", "gpt-oss", "qwen2"])
def test_layer_types_follow_the_config_classes(config: Any) -> None:
    layer_types, window = _ours(config)
    assert list(layer_types or []) == list(config.layer_types)
    assert window == config.sliding_window


def test_mistral_window_slides_every_layer_and_null_is_full() -> None:
    config = MistralConfig(**TINY, num_hidden_layers=3, sliding_window=16)
    layer_types, window = _ours(config)
    assert layer_types == ("sliding_attention",) * 3 and window == 16
    data = {**config.to_dict(), "sliding_window": None}
    assert model_spec_from_config(data).layer_types is None


def test_qwen3_moe_layers_follow_mlp_only_layers_and_sparse_step() -> None:
    config = Qwen3MoeConfig(**TINY, num_hidden_layers=6, moe_intermediate_size=24, num_experts=8,
                            num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    spec = model_spec_from_config(json.loads(json.dumps(config.to_dict())))
    # transformers: layer i is sparse when i not in mlp_only_layers and (i + 1) % step == 0
    sparse = [i for i in range(6) if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0]
    assert sorted(set(range(6)) - set(spec.dense_mlp_layers)) == sparse == [1, 5]
    assert (spec.num_experts, spec.num_experts_per_token, spec.expert_ffn_hidden) == (8, 2, 24)
