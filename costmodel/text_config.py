"""A text decoder's ``ModelSpec`` from its transformers ``config.json`` (dense, MoE, windowed).

Every family gives ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads`` (default: the query heads), ``head_dim`` (default
``hidden_size // num_attention_heads``), ``intermediate_size``, ``vocab_size`` and
``tie_word_embeddings`` (default false; true for Gemma 3, as its config class says): a kind ``1d``,
causal, gated-MLP decoder (SwiGLU; Gemma 3's GeGLU and gpt-oss' clamped SwiGLU cost the same three
matrices). On top, per family, as transformers 5.24's config classes derive them:

- Mixture of experts: ``num_experts`` (Qwen3-MoE; or ``num_local_experts``, Mixtral and gpt-oss),
  ``num_experts_per_tok``, the expert width ``moe_intermediate_size`` (Qwen3-MoE) or
  ``intermediate_size`` (Mixtral, gpt-oss), ``num_shared_experts`` where a config has it. Qwen3-MoE
  layer ``i`` is MoE unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``;
  its dense layers are ``intermediate_size`` wide.
- Windows: ``layer_types`` when the config lists it; otherwise gpt-oss alternates sliding and full
  layers (sliding first), Gemma 3 makes every ``sliding_window_pattern``-th layer full (default
  6, window default 4096), Mistral and Mixtral slide every layer when ``sliding_window`` is set,
  Qwen2 and Qwen3 slide the layers from ``max_window_layers`` (default 28) on and Qwen3-MoE every
  layer, both only with ``use_sliding_window``.
- gpt-oss has a learned attention sink per head (``attention_sinks``).

A Gemma 3 multimodal config (``model_type: gemma3``) is read through its ``text_config``: the
language model is what the planner costs (the vision tower is not counted).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from costmodel.config_fields import ConfigFields
from costmodel.specs import ModelSpec

TEXT_FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
"""transformers ``model_type`` -> its causal-LM class in ``architectures``."""

MULTIMODAL_TEXT: dict[str, str] = {"gemma3": "Gemma3ForConditionalGeneration"}
"""``model_type`` (and class) of multimodal configs read through their ``text_config``."""

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "tie_word_embeddings": True, "sliding_window": 4096,
                    "sliding_window_pattern": 6},
    "gpt_oss": {"sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1},
}
"""Config-class defaults (transformers 5.24) a ``config.json`` may leave out."""

LAYER_TYPES = ("full_attention", "sliding_attention")


def _heads(f: ConfigFields, *, hidden: int, heads: int, kv_heads: int, head_dim: int | None) -> int | None:
    """Check the heads divide; the head size to store (None when it is ``hidden // heads``)."""
    if heads % kv_heads:
        raise f.error(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
    if head_dim is None and hidden % heads:
        raise f.error(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} (give head_dim)")
    if head_dim is not None and head_dim * heads == hidden:
        return None
    return head_dim


def _window(f: ConfigFields, family: str) -> int | None:
    """The sliding window when the family's layers use one, else None."""
    value = f.data.get("sliding_window")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise f.error(f"field 'sliding_window' must be a positive integer, got {value!r}")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not f.flag("use_sliding_window", False):
        return None
    return None if family == "llama" else value


def _layer_types(f: ConfigFields, family: str, num_layers: int, window: int | None) -> list[str] | None:
    """Each layer's attention: the config's ``layer_types``, else the family's rule."""
    given = f.data.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or any(t not in LAYER_TYPES for t in given):
            raise f.error(f"field 'layer_types' must be a list of {' or '.join(LAYER_TYPES)}, got {given!r}")
        if len(given) != num_layers:
            raise f.error(f"field 'layer_types' has {len(given)} entries but num_hidden_layers={num_layers}")
        if "sliding_attention" in given and window is None:
            raise f.error("field 'layer_types' has sliding_attention layers but 'sliding_window' is not set")
        return given if "sliding_attention" in given else None
    if window is None:
        return None
    if family == "gpt_oss":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if family == "gemma3_text":
        pattern = f.integer("sliding_window_pattern")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if family in ("qwen2", "qwen3"):
        first = f.integer("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return types if "sliding_attention" in types else None
    return ["sliding_attention"] * num_layers


def _experts(f: ConfigFields, family: str, num_layers: int, ffn: int) -> dict[str, Any]:
    """The MoE fields of ``ModelSpec`` (empty for a dense family)."""
    if family not in ("mixtral", "qwen3_moe", "gpt_oss"):
        return {}
    key = "num_experts" if family == "qwen3_moe" and "num_local_experts" not in f.data else "num_local_experts"
    experts = f.integer(key)
    per_token = f.integer("num_experts_per_tok")
    if per_token > experts:
        raise f.error(f"field 'num_experts_per_tok'={per_token} is above {key}={experts}")
    dense: list[int] = []
    width = ffn
    if family == "qwen3_moe":
        width = f.integer("moe_intermediate_size")
        only = f.integers("mlp_only_layers", [])
        if any(i >= num_layers for i in only):
            raise f.error(f"field 'mlp_only_layers'={only} names layers past num_hidden_layers={num_layers}")
        step = f.integer("decoder_sparse_step")
        dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
    shared = f.data.get("num_shared_experts", 0)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise f.error(f"field 'num_shared_experts' must be an integer >= 0, got {shared!r}")
    return {"num_experts": experts, "num_experts_per_token": per_token, "expert_ffn_hidden": width,
            "num_shared_experts": shared, "dense_mlp_layers": tuple(dense)}


def text_spec(data: Mapping[str, Any], family: str, name: str, source: str) -> ModelSpec:
    """The ``ModelSpec`` of a transformers text decoder of ``family`` (a ``TEXT_FAMILIES`` key)."""
    f = ConfigFields({**FAMILY_DEFAULTS.get(family, {}), **data}, source)
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    kv = f.integer("num_key_value_heads", heads)
    head_dim = _heads(f, hidden=hidden, heads=heads, kv_heads=kv, head_dim=f.optional_int("head_dim"))
    num_layers = f.integer("num_hidden_layers")
    ffn = f.integer("intermediate_size")
    window = _window(f, family)
    types = _layer_types(f, family, num_layers, window)
    return ModelSpec(name=name, kind="1d", num_layers=num_layers, hidden=hidden,
                     num_heads=heads, num_kv_heads=None if kv == heads else kv, head_dim=head_dim,
                     ffn_hidden=ffn, vocab=f.integer("vocab_size"),
                     tied_embeddings=f.flag("tie_word_embeddings", False), causal=True,
                     layer_types=None if types is None else tuple(types),  # type: ignore[arg-type]
                     sliding_window=window if types is not None else None,
                     attention_sinks=family == "gpt_oss", mlp="swiglu_clamped" if family == "gpt_oss" else None,
                     family=family, **_experts(f, family, num_layers, ffn))
