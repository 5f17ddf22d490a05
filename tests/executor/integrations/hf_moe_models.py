"""The mixture-of-experts and windowed-attention ``transformers`` classes of the integration tests.

Small random configurations (no download) of ``Qwen3MoeForCausalLM``, ``GptOssForCausalLM``,
``Gemma3ForCausalLM`` (text), ``MistralForCausalLM`` with ``sliding_window`` and
``MixtralForCausalLM``: 8 query heads over 2 key/value heads (the scenarios' groups of 4 run past
the key/value heads), 3 decoder layers (the scenario plans' policies range over 0..3), 4 experts of
which 2 per token, windows of 4 tokens (shorter than most scenario samples, so the window masks).

- Qwen3-MoE: layer 1 a dense MLP (``mlp_only_layers``), the others sparse; query/key norms.
- gpt-oss: sliding, full, sliding layers (``layer_types``), sinks on every layer, experts with
  biases and the clamped SwiGLU, YaRN rope.
- Gemma 3: local, global, local layers (``layer_types``), query/key norms, the
  ``query_pre_attn_scalar`` scaling, a local rope base apart from the global one and the scaled
  embeddings, tied head.
- Mistral: every layer slides (``sliding_window``).
- Mixtral: full attention, sparse MLP on every layer.

Gemma 3's RMS norms compute in fp32 whatever the model's dtype (``Gemma3RMSNorm.forward`` casts with
``.float()``), so their weights' gradients are sums over tokens in fp32 that differ with the order of
the tokens: :func:`tolerance` gives them 1e-6 (as ``test_hf_wan.py`` does for Wan's fp32 reductions),
every other parameter of every model 1e-10.

The experts run ``experts_implementation="eager"`` (the per-expert loop): the default
``grouped_mm`` takes fp32 and half precision only, and the exact tests run fp64. The references are
the plain classes with ``sdpa`` (gpt-oss has only ``eager``, whose softmax keeps fp64 in fp64).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.executor.helpers import CONFIG

NUM_LAYERS = CONFIG.num_layers
WINDOW = 4
"""Tokens of every sliding window."""
KV_HEADS = 2
NAMES = ("qwen3_moe", "gpt_oss", "gemma3", "mistral_sw", "mixtral")
"""The models, by the key the tests use."""
_COMMON: dict[str, Any] = {"vocab_size": CONFIG.vocab, "hidden_size": 32, "num_hidden_layers": NUM_LAYERS,
                           "num_attention_heads": 8, "num_key_value_heads": KV_HEADS, "head_dim": 4,
                           "max_position_embeddings": 64, "attention_dropout": 0.0}
_MIXED = ["sliding_attention", "full_attention", "sliding_attention"]


def config(name: str) -> Any:
    """The small configuration of model ``name`` (one of :data:`NAMES`)."""
    import transformers as tf

    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                 num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True)
    if name == "gpt_oss":
        return tf.GptOssConfig(**_COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=WINDOW, layer_types=_MIXED,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0,
                                                "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "truncate": False})
    if name == "gemma3":
        return tf.Gemma3TextConfig(**_COMMON, intermediate_size=48, sliding_window=WINDOW, layer_types=_MIXED,
                                   query_pre_attn_scalar=8,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                    "full_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}})
    if name == "mistral_sw":
        return tf.MistralConfig(**_COMMON, intermediate_size=48, sliding_window=WINDOW)
    if name == "mixtral":
        return tf.MixtralConfig(**_COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"unknown test model {name!r}; one of {NAMES}")


def model_class(name: str) -> Any:
    import transformers as tf

    return {"qwen3_moe": tf.Qwen3MoeForCausalLM, "gpt_oss": tf.GptOssForCausalLM, "gemma3": tf.Gemma3ForCausalLM,
            "mistral_sw": tf.MistralForCausalLM, "mixtral": tf.MixtralForCausalLM}[name]


def reference_attention(name: str) -> str:
    """The plain model's attention: ``sdpa``, gpt-oss ``eager`` (it has no ``sdpa``)."""
    return "eager" if name == "gpt_oss" else "sdpa"


def build(name: str, attn_implementation: str, *, dtype: torch.dtype, seed: int = 0) -> Any:
    """Model ``name`` with the given attention, deterministically initialised (same on every rank)."""
    torch.manual_seed(seed)
    model = model_class(name)._from_config(copy.deepcopy(config(name)), attn_implementation=attn_implementation,
                                           experts_implementation="eager")
    return model.to(dtype)


EXACT = 1e-10
"""Relative bound of losses and gradients (fp64)."""
FP32_REDUCED = 1e-6
"""Relative bound of the gradients a model reduces in fp32 (Gemma 3's norm weights)."""


def tolerance(name: str, parameter: str) -> float:
    """The relative bound of parameter ``parameter``'s gradient in model ``name``."""
    return FP32_REDUCED if name == "gemma3" and parameter.endswith("norm.weight") else EXACT
