"""The model's own layer classes from transformers and diffusers, built from a ``config.json``.

:func:`real_blocks` turns a config (the JSON object of a transformers ``config.json`` of the
Llama, Qwen2, Qwen3 or Mistral families, or of a diffusers ``WanTransformer3DModel`` or
``HunyuanVideoTransformer3DModel``) into a :class:`RealBlocks`: a factory of the model's own
decoder layer or transformer block (random weights, nothing downloaded), the inputs one sample
of ``s`` tokens gives it (hidden states, rotary tables from the model's own rotary module, the
text states and timestep embedding of a video block) and how to call it. What the blocks save
for backward is then counted by :mod:`costmodel.profiling.module_count`.

How each family's block is called:

* transformers decoder layers (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``,
  ``MistralDecoderLayer``): ``layer(h, position_embeddings=(cos, sin), position_ids=...)`` with
  ``attn_implementation="sdpa"`` and no mask, so grouped-query heads go to
  ``scaled_dot_product_attention`` unrepeated (``enable_gqa``), causal, as flash attention runs
  them in training;
* ``WanTransformerBlock``: ``block(h, text, temb, rotary)`` with the per-token timestep
  modulation ``(1, s, 6, D)`` (the form the executor's ``hf_wan`` integration and Wan 2.2 use:
  every token gets its own sample's timestep), ``text`` the 512 umT5 states after the model's
  text projection;
* ``HunyuanVideoTransformerBlock`` (dual-stream) and ``HunyuanVideoSingleTransformerBlock``:
  ``block(h, text, temb, None, rotary)`` returning ``(h, text)``, the 256 text tokens joined
  to the attention.

A config whose class cannot be imported (no transformers or diffusers installed, or a version
without the class) raises :class:`NoRealClassError`; callers fall back to the look-alike blocks
of :mod:`costmodel.profiling.blocks` and say so.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from costmodel.model_config import HUNYUAN_TEXT_TOKENS, TEXT_FAMILIES, WAN_TEXT_TOKENS
from costmodel.specs import ModelSpec

TEXT_LAYER_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaDecoderLayer", "LlamaRotaryEmbedding"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2RotaryEmbedding"),
    "qwen3": ("Qwen3DecoderLayer", "Qwen3RotaryEmbedding"),
    "mistral": ("MistralDecoderLayer", "MistralRotaryEmbedding"),
}
"""transformers ``model_type`` -> (decoder layer class, rotary embedding class) of its modeling module."""

BLOCK_KINDS: dict[str, tuple[str, ...]] = {
    "llama": ("layer",), "qwen2": ("layer",), "qwen3": ("layer",), "mistral": ("layer",),
    "wan": ("block",), "hunyuanvideo": ("dual", "single"),
}
"""Architecture family -> the kinds of layer it stacks (HunyuanVideo: dual-stream, then single-stream)."""


class NoRealClassError(ValueError):
    """The config's layer class cannot be imported (the look-alike blocks stand in for it)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class BlockInputs:
    """What one sample gives a stack of blocks."""

    state: tuple[torch.Tensor, ...]
    """Tensors that flow from block to block (hidden states; with joint attention also the text
    states), each ``requires_grad``: a checkpointed block keeps them."""
    context: tuple[Any, ...]
    """Inputs every block reads and no block changes (rotary tables, text states, timestep
    embedding): made once per forward outside the blocks, so not counted as a block's bytes."""
    tokens: int
    """The sample's tokens (video: patch tokens)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RealBlocks:
    """A model's own layer class, ready to instantiate and call."""

    family: str
    """Architecture family (``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``wan``, ``hunyuanvideo``)."""
    block_kind: str
    """Which of the family's layers (``layer``, ``block``, or HunyuanVideo's ``dual`` / ``single``)."""
    class_name: str
    """The class instantiated, ``module.Class``."""
    factory: Callable[[int], nn.Module]
    """``factory(index)``: a new block with random weights (``index`` is the layer index)."""
    make_inputs: Callable[..., BlockInputs]
    """``make_inputs(tokens, device=..., dtype=..., generator=...)``: one sample's inputs."""
    call: Callable[[nn.Module, tuple[torch.Tensor, ...], tuple[Any, ...]], tuple[torch.Tensor, ...]]
    """``call(block, state, context)``: the block's forward; the new state."""
    versions: dict[str, str] = field(default_factory=dict)
    """Versions of torch and the library the class comes from."""


def _import(module: str, names: tuple[str, ...], what: str) -> tuple[Any, ...]:
    try:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, n) for n in names)
    except (ImportError, AttributeError) as exc:
        raise NoRealClassError(f"{what}: cannot import {', '.join(names)} from {module} ({exc})") from None


def _version(package: str) -> str:
    return str(importlib.import_module(package).__version__)


def _tensor(shape: tuple[int, ...], *, device: torch.device, dtype: torch.dtype, generator: torch.Generator,
            grad: bool = False) -> torch.Tensor:
    t = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


def _text_blocks(data: Mapping[str, Any], family: str) -> RealBlocks:
    layer_name, rope_name = TEXT_LAYER_CLASSES[family]
    what = f"model_type={family!r}"
    (config_cls,) = _import("transformers", (f"{TEXT_FAMILIES[family].removesuffix('ForCausalLM')}Config",), what)
    layer_cls, rope_cls = _import(f"transformers.models.{family}.modeling_{family}", (layer_name, rope_name), what)
    fields = {k: v for k, v in data.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype")}
    fields.update(vocab_size=8, use_cache=False, sliding_window=None, use_sliding_window=False)
    config = config_cls(**fields)
    config._attn_implementation = "sdpa"
    rope = rope_cls(config)

    def make_inputs(tokens: int, *, device: torch.device, dtype: torch.dtype,
                    generator: torch.Generator) -> BlockInputs:
        h = _tensor((1, tokens, config.hidden_size), device=device, dtype=dtype, generator=generator, grad=True)
        positions = torch.arange(tokens, device=device)[None]
        cos, sin = rope.to(device)(h, positions)
        return BlockInputs(state=(h,), context=((cos.to(dtype), sin.to(dtype)), positions), tokens=tokens)

    def call(block: nn.Module, state: tuple[torch.Tensor, ...], context: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        out = block(state[0], position_embeddings=context[0], position_ids=context[1], use_cache=False)
        return (out[0] if isinstance(out, tuple) else out,)

    return RealBlocks(family=family, block_kind="layer", class_name=f"{layer_cls.__module__}.{layer_name}",
                      factory=lambda index: layer_cls(config, index), make_inputs=make_inputs, call=call,
                      versions={"torch": torch.__version__, "transformers": _version("transformers")})


def _frames_grid(tokens: int) -> tuple[int, int, int]:
    """A clip shape ``(frames, height, width)`` in patches of ``tokens`` tokens (near-square frames
    of at most 1,024 tokens, so the rotary tables of every axis stay in range)."""
    frames = max(1, math.ceil(tokens / 1024))
    while tokens % frames:
        frames += 1
    per_frame = tokens // frames
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    return frames, height, per_frame // height


def _wan_blocks(data: Mapping[str, Any]) -> RealBlocks:
    what = "_class_name='WanTransformer3DModel'"
    block_cls, rope_cls = _import("diffusers.models.transformers.transformer_wan",
                                  ("WanTransformerBlock", "WanRotaryPosEmbed"), what)
    heads, head_dim = int(data["num_attention_heads"]), int(data["attention_head_dim"])
    dim, ffn = heads * head_dim, int(data["ffn_dim"])
    patch = tuple(int(p) for p in data.get("patch_size", (1, 2, 2)))
    rope = rope_cls(head_dim, patch, int(data.get("rope_max_seq_len", 1024)))
    text_tokens = int(data.get("text_tokens", WAN_TEXT_TOKENS))

    def factory(index: int) -> nn.Module:
        return block_cls(dim, ffn, heads, data.get("qk_norm", "rms_norm_across_heads"),
                         bool(data.get("cross_attn_norm", True)), float(data.get("eps", 1e-6)), None)

    def make_inputs(tokens: int, *, device: torch.device, dtype: torch.dtype,
                    generator: torch.Generator) -> BlockInputs:
        frames, height, width = _frames_grid(tokens)
        clip = torch.empty((1, 1, frames * patch[0], height * patch[1], width * patch[2]), device=device)
        cos, sin = rope.to(device)(clip)
        h = _tensor((1, tokens, dim), device=device, dtype=dtype, generator=generator, grad=True)
        text = _tensor((1, text_tokens, dim), device=device, dtype=dtype, generator=generator)
        temb = _tensor((1, tokens, 6, dim), device=device, dtype=dtype, generator=generator)
        return BlockInputs(state=(h,), context=(text, temb, (cos, sin)), tokens=tokens)

    def call(block: nn.Module, state: tuple[torch.Tensor, ...], context: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        return (block(state[0], *context),)

    return RealBlocks(family="wan", block_kind="block", class_name=f"{block_cls.__module__}.WanTransformerBlock",
                      factory=factory, make_inputs=make_inputs, call=call,
                      versions={"torch": torch.__version__, "diffusers": _version("diffusers")})


def _hunyuan_blocks(data: Mapping[str, Any], block_kind: str) -> RealBlocks:
    what = "_class_name='HunyuanVideoTransformer3DModel'"
    name = "HunyuanVideoTransformerBlock" if block_kind == "dual" else "HunyuanVideoSingleTransformerBlock"
    block_cls, rope_cls = _import("diffusers.models.transformers.transformer_hunyuan_video",
                                  (name, "HunyuanVideoRotaryPosEmbed"), what)
    heads, head_dim = int(data["num_attention_heads"]), int(data["attention_head_dim"])
    dim, mlp_ratio = heads * head_dim, float(data.get("mlp_ratio", 4.0))
    patch, patch_t = int(data.get("patch_size", 2)), int(data.get("patch_size_t", 1))
    rope_axes = list(data.get("rope_axes_dim", (16, 56, 56)))
    if sum(rope_axes) != head_dim:  # a narrowed head: split it over the axes as the model's 16/56/56 do
        rope_axes = [2 * (head_dim // 16), 2 * ((head_dim - 2 * (head_dim // 16)) // 4)]
        rope_axes.append(head_dim - sum(rope_axes))
    rope = rope_cls(patch, patch_t, rope_axes, float(data.get("rope_theta", 256.0)))
    text_tokens = int(data.get("text_tokens", HUNYUAN_TEXT_TOKENS))
    qk_norm = data.get("qk_norm", "rms_norm")

    def make_inputs(tokens: int, *, device: torch.device, dtype: torch.dtype,
                    generator: torch.Generator) -> BlockInputs:
        frames, height, width = _frames_grid(tokens)
        clip = torch.empty((1, 1, frames * patch_t, height * patch, width * patch), device=device)
        cos, sin = rope.to(device)(clip)
        h = _tensor((1, tokens, dim), device=device, dtype=dtype, generator=generator, grad=True)
        text = _tensor((1, text_tokens, dim), device=device, dtype=dtype, generator=generator, grad=True)
        temb = _tensor((1, dim), device=device, dtype=dtype, generator=generator)
        return BlockInputs(state=(h, text), context=(temb, None, (cos, sin)), tokens=tokens)

    def call(block: nn.Module, state: tuple[torch.Tensor, ...], context: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        out = block(state[0], state[1], *context)
        return (out[0], out[1])

    return RealBlocks(family="hunyuanvideo", block_kind=block_kind, class_name=f"{block_cls.__module__}.{name}",
                      factory=lambda index: block_cls(heads, head_dim, mlp_ratio, qk_norm),
                      make_inputs=make_inputs, call=call,
                      versions={"torch": torch.__version__, "diffusers": _version("diffusers")})


def config_family(data: Mapping[str, Any]) -> str:
    """The architecture family of a config's JSON object.

    Raises:
        NoRealClassError: for a config of no family this module builds.
    """
    class_name = data.get("_class_name")
    if class_name == "WanTransformer3DModel":
        return "wan"
    if class_name == "HunyuanVideoTransformer3DModel":
        return "hunyuanvideo"
    model_type = data.get("model_type")
    if class_name is None and model_type in TEXT_LAYER_CLASSES:
        return str(model_type)
    raise NoRealClassError(f"no real layer class for model_type={model_type!r}, _class_name={class_name!r}; "
                           f"known families: {', '.join(BLOCK_KINDS)}")


def real_blocks(data: Mapping[str, Any], *, block_kind: str | None = None) -> RealBlocks:
    """The model's own layer class for a transformers or diffusers config's JSON object.

    Args:
        data: The ``config.json`` object (e.g. :func:`config_of` of a spec).
        block_kind: Which of the family's layers (default: its first; HunyuanVideo ``dual`` or
            ``single``).

    Raises:
        NoRealClassError: when the family is unknown or its class cannot be imported.
        ValueError: for a ``block_kind`` the family does not have.
    """
    family = config_family(data)
    kinds = BLOCK_KINDS[family]
    kind = block_kind or kinds[0]
    if kind not in kinds:
        raise ValueError(f"block_kind={kind!r}: the {family} family has {', '.join(kinds)}")
    if family == "wan":
        return _wan_blocks(data)
    if family == "hunyuanvideo":
        return _hunyuan_blocks(data, kind)
    return _text_blocks(data, family)


def config_of(spec: ModelSpec, *, family: str | None = None) -> dict[str, Any]:
    """A config's JSON object with the widths of ``spec`` (its family's field names).

    Used to build the real classes at narrowed widths (tests, the coefficient fit); a user's own
    ``config.json`` is read as is by :func:`real_blocks`.

    Raises:
        NoRealClassError: when the spec names no family (and none is given).
    """
    fam = family or spec.family
    if fam is None:
        raise NoRealClassError(f"model {spec.name!r} has no architecture family; known: {', '.join(BLOCK_KINDS)}")
    if fam in TEXT_LAYER_CLASSES:
        return {"model_type": fam, "hidden_size": spec.hidden, "num_attention_heads": spec.num_heads,
                "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_size,
                "intermediate_size": spec.ffn_hidden, "num_hidden_layers": spec.num_layers,
                "vocab_size": max(spec.vocab, 8), "rms_norm_eps": 1e-6}
    patch = spec.patch_size or (1, 2, 2)
    if fam == "wan":
        return {"_class_name": "WanTransformer3DModel", "num_attention_heads": spec.num_heads,
                "attention_head_dim": spec.head_size, "ffn_dim": spec.ffn_hidden, "patch_size": list(patch),
                "num_layers": spec.num_layers, "in_channels": spec.latent_channels or 16,
                "text_tokens": spec.cross_attention_tokens or WAN_TEXT_TOKENS}
    if fam == "hunyuanvideo":
        return {"_class_name": "HunyuanVideoTransformer3DModel", "num_attention_heads": spec.num_heads,
                "attention_head_dim": spec.head_size, "mlp_ratio": spec.ffn_hidden / spec.hidden,
                "patch_size": patch[1], "patch_size_t": patch[0], "num_layers": spec.dual_stream_layers,
                "num_single_layers": spec.num_layers - spec.dual_stream_layers,
                "in_channels": spec.latent_channels or 16,
                "text_tokens": spec.joint_attention_tokens or HUNYUAN_TEXT_TOKENS}
    raise NoRealClassError(f"unknown architecture family {fam!r}; known: {', '.join(BLOCK_KINDS)}")
