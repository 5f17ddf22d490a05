"""A ``ModelSpec`` from the ``config.json`` a user already has (transformers or diffusers).

Only the JSON is read (no transformers or diffusers import). Two kinds of files:

- A transformers ``config.json`` of a text decoder (``model_type`` or ``architectures``): Llama,
  Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, gpt-oss, Gemma 3 (``costmodel.text_config``: the
  dense shape, experts, each layer's attention, sinks) gives a kind ``1d`` causal decoder.
- A diffusers transformer ``config.json`` (``_class_name``):

  - ``WanTransformer3DModel`` (Wan 2.x): ``num_layers``, ``num_attention_heads``,
    ``attention_head_dim``, ``ffn_dim``, ``patch_size`` ``[t, h, w]``, ``in_channels``; every block
    cross-attends to the 512 tokens of its umT5 text encoder (``max_sequence_length=512`` in
    diffusers' ``WanPipeline``), plus 257 CLIP image tokens for the image-conditioned variants
    (``image_dim`` set; ``pos_embed_seq_len`` when given).
  - ``HunyuanVideoTransformer3DModel`` (MMDiT-style joint attention): ``num_layers`` dual-stream
    plus ``num_single_layers`` single-stream blocks, ``num_attention_heads``,
    ``attention_head_dim``, ``mlp_ratio``, ``patch_size`` (h, w) and ``patch_size_t``; the 256
    text tokens of its pipeline (``max_sequence_length=256`` in ``HunyuanVideoPipeline``) join
    every self-attention. Chosen over CogVideoX (226 text tokens) because HunyuanVideo trains at
    mixed resolutions and durations with rotary positions (what this planner is for), while
    CogVideoX 1.0's config ties its positional embedding to one ``sample_frames`` x
    ``sample_height`` x ``sample_width``.

  Both are kind ``3d`` (one non-causal self-attention over all frames x height x width patch
  tokens of a clip per block), GELU MLP, VAE stride (4, 8, 8) (both models' public VAEs), latent
  channels ``out_channels`` (else ``in_channels``).

Bad input is a ``ValueError`` naming the file (or ``source``) and the missing or bad field,
the unknown architecture (with the known ones), or the heads that do not divide.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from costmodel.config_fields import ConfigFields
from costmodel.specs import ModelSpec
from costmodel.text_config import MULTIMODAL_TEXT, TEXT_FAMILIES, text_spec

WAN_TEXT_TOKENS = 512
"""Text tokens a Wan 2.x block cross-attends to (umT5, ``max_sequence_length=512``)."""
WAN_IMAGE_TOKENS = 257
"""CLIP image tokens of image-conditioned Wan models (ViT-H/14 at 224 px: 16 x 16 + 1)."""
HUNYUAN_TEXT_TOKENS = 256
"""Text tokens joined to each HunyuanVideo self-attention (``max_sequence_length=256``)."""
VIDEO_VAE_STRIDE = (4, 8, 8)
"""(t, h, w) compression of the Wan 2.1 and HunyuanVideo VAEs."""

_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def _video(f: ConfigFields, name: str, *, num_layers: int, heads: int, head_dim: int, ffn_hidden: int,
           patch: tuple[int, int, int], cross_tokens: int = 0, joint_tokens: int = 0, dual_stream_layers: int = 0,
           attention: str | None = None, family: str) -> ModelSpec:
    channels = f.optional_int("out_channels") or f.integer("in_channels")
    return ModelSpec(name=name, kind="3d", num_layers=num_layers, hidden=heads * head_dim,
                     num_heads=heads, ffn_hidden=ffn_hidden, causal=False,
                     cross_attention_tokens=cross_tokens, joint_attention_tokens=joint_tokens,
                     dual_stream_layers=dual_stream_layers, patch_size=patch, vae_stride=VIDEO_VAE_STRIDE,
                     latent_channels=channels, attention=attention, family=family)


def _wan(f: ConfigFields, name: str) -> ModelSpec:
    cross = WAN_TEXT_TOKENS
    if f.data.get("image_dim") is not None:
        cross += f.optional_int("pos_embed_seq_len") or WAN_IMAGE_TOKENS
    return _video(f, name, num_layers=f.integer("num_layers"), heads=f.integer("num_attention_heads"),
                  head_dim=f.integer("attention_head_dim"), ffn_hidden=f.integer("ffn_dim"),
                  patch=f.triple("patch_size"), cross_tokens=cross, family="wan")


def _hunyuan(f: ConfigFields, name: str) -> ModelSpec:
    heads, head_dim = f.integer("num_attention_heads"), f.integer("attention_head_dim")
    ffn = heads * head_dim * f.number("mlp_ratio")
    if ffn != int(ffn):
        raise f.error(f"mlp_ratio={f.data['mlp_ratio']!r} x hidden {heads * head_dim} is not a whole MLP size")
    patch = (f.integer("patch_size_t"), f.integer("patch_size"), f.integer("patch_size"))
    dual, single = f.integer("num_layers"), f.integer("num_single_layers")
    note = (f"{dual} dual-stream + {single} single-stream blocks; {HUNYUAN_TEXT_TOKENS} text tokens "
            "joined to every self-attention")
    return _video(f, name, num_layers=dual + single, heads=heads, head_dim=head_dim, ffn_hidden=int(ffn),
                  patch=patch, joint_tokens=HUNYUAN_TEXT_TOKENS, dual_stream_layers=dual, attention=note,
                  family="hunyuanvideo")


VIDEO_CLASSES: dict[str, Callable[[ConfigFields, str], ModelSpec]] = {
    "WanTransformer3DModel": _wan,
    "HunyuanVideoTransformer3DModel": _hunyuan,
}
"""diffusers ``_class_name`` -> its reader."""


def known_architectures() -> list[str]:
    """Every ``model_type``, ``architectures`` entry and ``_class_name`` this module reads."""
    return [*TEXT_FAMILIES, *TEXT_FAMILIES.values(), *MULTIMODAL_TEXT, *MULTIMODAL_TEXT.values(),
            *VIDEO_CLASSES]


def _unknown(f: ConfigFields, what: str) -> ValueError:
    return f.error(f"unknown architecture {what}; known: {', '.join(known_architectures())}")


def _text_family(f: ConfigFields) -> str | None:
    model_type = f.data.get("model_type")
    architectures = f.data.get("architectures")
    if model_type is not None:
        if model_type in MULTIMODAL_TEXT:
            return str(model_type)
        if model_type not in TEXT_FAMILIES:
            raise _unknown(f, f"model_type={model_type!r}")
        return str(model_type)
    if architectures is not None:
        if not isinstance(architectures, list) or not architectures:
            raise f.error(f"field 'architectures' must be a non-empty list, got {architectures!r}")
        by_class = {cls: family for family, cls in (*TEXT_FAMILIES.items(), *MULTIMODAL_TEXT.items())}
        if architectures[0] not in by_class:
            raise _unknown(f, f"architectures={architectures!r}")
        return by_class[architectures[0]]
    return None


def _sanitize(name: str) -> str:
    return _NAME_CHARS.sub("-", name).strip("-.")


def _default_name(data: Mapping[str, Any], path: Path | None, family: str) -> str:
    given = data.get("_name_or_path")
    if isinstance(given, str) and _sanitize(given.rstrip("/").rsplit("/", 1)[-1]):
        return _sanitize(given.rstrip("/").rsplit("/", 1)[-1])
    if path is not None:
        folder = path.parent
        if folder.name == "transformer":  # a diffusers pipeline: <model>/transformer/config.json
            folder = folder.parent
        base = folder.name if path.name == "config.json" else path.stem
        if _sanitize(base):
            return _sanitize(base)
    layers = data.get("num_hidden_layers", data.get("num_layers"))
    hidden = data.get("hidden_size", data.get("num_attention_heads"))
    return _sanitize(f"{family}-{layers}l-{hidden}")


def _read(path: Path, source: str) -> tuple[dict[str, Any], Path]:
    if path.is_dir():
        for candidate in (path / "config.json", path / "transformer" / "config.json"):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise ValueError(f"{source}: a folder without config.json or transformer/config.json")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the model config ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a model config is a JSON object, got {type(data).__name__}")
    return data, path


def model_spec_from_config(config: str | Path | Mapping[str, Any], *, name: str | None = None,
                           source: str | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a transformers or diffusers ``config.json``.

    Args:
        config: A path to the ``config.json`` (or to a model folder holding ``config.json`` or
            ``transformer/config.json``), or the parsed JSON object.
        name: The model's name (default: the config's ``_name_or_path``, else the model folder's
            name, else ``<family>-<layers>l-<hidden>``); characters outside ``[A-Za-z0-9._-]``
            become ``-``.
        source: How errors name the config (default: the path, or ``model_config``).

    Returns:
        The spec: kind ``1d`` for the transformers families, ``3d`` for the diffusers classes.

    Raises:
        ValueError: naming the source and the missing or bad field, the unknown architecture
            (listing the known ones), or heads that do not divide.
    """
    path = None if isinstance(config, Mapping) else Path(config)
    label = source or (str(path) if path is not None else "model_config")
    if path is None:
        data = dict(config)  # type: ignore[arg-type]
    else:
        data, path = _read(path, label)
    f = ConfigFields(data, label)
    class_name = data.get("_class_name")
    family = None if class_name is not None else _text_family(f)
    if class_name is None and family is None:
        raise f.error("no 'model_type', 'architectures' or '_class_name': not a transformers or "
                      f"diffusers config; known: {', '.join(known_architectures())}")
    if class_name is not None and class_name not in VIDEO_CLASSES:
        raise _unknown(f, f"_class_name={class_name!r}")
    label_name = family or str(class_name).removesuffix("Transformer3DModel").lower()
    spec_name = _sanitize(name) if name is not None else _default_name(data, path, label_name)
    if not spec_name:
        raise f.error(f"name={name!r} has no letters or digits")
    try:
        if family in MULTIMODAL_TEXT:
            text = data.get("text_config")
            if not isinstance(text, dict):
                raise f.error(f"model_type={family!r} needs a 'text_config' object (its language model)")
            return text_spec(text, f"{family}_text", spec_name, label)
        if family is not None:
            return text_spec(data, family, spec_name, label)
        return VIDEO_CLASSES[str(class_name)](f, spec_name)
    except ValueError as exc:
        if str(exc).startswith(f"{label}: "):
            raise
        raise f.error(str(exc)) from None


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a ``config.json`` (or of a model folder's ``config.json`` or
    ``transformer/config.json``).

    Raises:
        ValueError: naming the path when it cannot be read or is not a JSON object.
    """
    return _read(Path(path), str(path))[0]
