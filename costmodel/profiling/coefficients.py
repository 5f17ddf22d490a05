"""Count the activation-bytes coefficients of every family on its real layer classes.

For each family and kind of layer (:data:`costmodel.profiling.real_classes.BLOCK_KINDS`) this
builds the model's own class at a few narrow shapes chosen so that the widths (``hidden``,
``inner``, ``kv_inner``, ``ffn``, ``heads``) vary independently, counts the bytes one layer
saves for backward in bfloat16 (:func:`costmodel.profiling.module_count.saved_bytes`, exact) at
two token counts, and solves for the coefficients of the linear form of
:mod:`costmodel.activation_table` by least squares (the counts are exact, so the fit is exact
up to rounding: the residuals are reported and must be zero):

* ``none``: the slope over tokens of a plain layer's bytes;
* ``full``: the slope of a checkpointed layer's bytes (its input);
* ``per_text_token`` and ``per_sample`` (cross-attention only): the bytes left at zero tokens
  are counted at ``T`` and ``2T`` text tokens; their difference over ``T`` is per text token, the
  rest per sample.

Regenerate the table (a few minutes on 2 cores)::

    python -m costmodel.profiling.coefficients --out costmodel/presets/activation_bytes.json
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from costmodel.activation_table import widths
from costmodel.profiling.module_count import default_dtype, saved_bytes
from costmodel.profiling.real_classes import BLOCK_KINDS, RealBlocks, config_of, real_blocks
from costmodel.specs import ModelSpec

logger = logging.getLogger(__name__)

FIT_TOKENS = (32, 96)
"""Token counts of each counted shape (the slope between them is the per-token bytes)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Shape:
    """One narrow shape the coefficients are counted at."""

    hidden: int
    heads: int
    ffn: int
    kv_heads: int | None = None
    head_dim: int | None = None
    text_tokens: int = 16


TEXT_SHAPES = (
    Shape(hidden=128, heads=2, kv_heads=1, head_dim=64, ffn=256),
    Shape(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=384),
    Shape(hidden=192, heads=4, kv_heads=4, head_dim=32, ffn=512),
    Shape(hidden=256, heads=8, kv_heads=2, head_dim=16, ffn=320),
    Shape(hidden=128, heads=4, kv_heads=1, head_dim=64, ffn=640),
    Shape(hidden=384, heads=6, kv_heads=3, head_dim=32, ffn=448),
    Shape(hidden=256, heads=2, kv_heads=2, head_dim=64, ffn=256),
    Shape(hidden=320, heads=10, kv_heads=5, head_dim=16, ffn=384),
)
"""Decoder-layer shapes: hidden, inner, key/value width, MLP and heads vary independently."""

VIDEO_SHAPES = (
    Shape(hidden=128, heads=2, ffn=256, text_tokens=16),
    Shape(hidden=256, heads=4, ffn=384, text_tokens=32),
    Shape(hidden=192, heads=6, ffn=512, text_tokens=8),
    Shape(hidden=256, heads=8, ffn=320, text_tokens=24),
    Shape(hidden=384, heads=6, ffn=640, text_tokens=16),
    Shape(hidden=128, heads=4, ffn=448, text_tokens=32),
)
"""Video-block shapes (head size = hidden / heads, as in Wan and HunyuanVideo)."""

VIDEO_BASIS = ("hidden", "ffn", "heads", "one")
TEXT_BASIS = ("hidden", "inner", "kv_inner", "ffn", "heads", "kv_heads", "one")
"""Widths a video block's form has (its ``inner`` and ``kv_inner`` equal ``hidden``)."""


def shape_spec(family: str, shape: Shape, *, text_tokens: int | None = None) -> ModelSpec:
    """A one-layer spec of ``family`` at ``shape``."""
    if family in ("wan", "hunyuanvideo"):
        joint = family == "hunyuanvideo"
        text = text_tokens or shape.text_tokens
        return ModelSpec(name=f"{family}-fit", kind="3d", num_layers=2, hidden=shape.hidden, num_heads=shape.heads,
                         ffn_hidden=shape.ffn, causal=False, patch_size=(1, 2, 2), family=family,
                         cross_attention_tokens=0 if joint else text, joint_attention_tokens=text if joint else 0,
                         dual_stream_layers=1 if joint else 0)
    return ModelSpec(name=f"{family}-fit", kind="1d", num_layers=2, hidden=shape.hidden, num_heads=shape.heads,
                     num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn_hidden=shape.ffn, vocab=8,
                     family=family)


def stack_counts(blocks: RealBlocks, *, tokens: Sequence[int], num_layers: int = 1,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[tuple[int, int], int]:
    """Saved bytes of a stack of ``num_layers`` blocks, ``(policy k, tokens) -> bytes`` for every
    ``k`` in ``0..num_layers`` (forward only: counting needs no backward)."""
    torch.manual_seed(seed)
    with default_dtype(dtype):  # weights made in the training dtype (half the memory of fp32 then a cast)
        stack = [blocks.factory(i).to(dtype=dtype) for i in range(num_layers)]
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for s in tokens:
        inputs = blocks.make_inputs(s, device=torch.device("cpu"), dtype=dtype, generator=generator)
        for k in range(num_layers + 1):
            out[(k, s)] = saved_bytes(stack, inputs, blocks.call, recompute_layers=k)
    return out


def ratio_spec(model: ModelSpec, *, heads: int, head_dim: int, num_layers: int = 2) -> ModelSpec:
    """``model`` narrowed to ``heads`` query heads of ``head_dim``, keeping its width ratios (hidden
    over attention width, query over key/value heads, MLP over hidden; MLP rounded to 8).

    Raises:
        ValueError: when ``heads`` is not a multiple of the query heads per key/value head.
    """
    group = model.num_heads // model.kv_heads
    if heads % group:
        raise ValueError(f"heads={heads} is not a multiple of {model.name}'s {group} query heads per key/value head")
    inner = heads * head_dim
    hidden = round(inner * model.hidden / (model.num_heads * model.head_size))
    ffn = max(8, round(hidden * model.ffn_hidden / model.hidden / 8) * 8)
    update: dict[str, object] = {"num_layers": num_layers, "hidden": hidden, "num_heads": heads, "ffn_hidden": ffn,
                                 "num_kv_heads": heads // group if model.num_kv_heads else None,
                                 "head_dim": head_dim if hidden != inner else None, "name": f"{model.name}-h{hidden}"}
    if model.dual_stream_layers:
        update["dual_stream_layers"] = max(1, round(num_layers * model.dual_stream_layers / model.num_layers))
    return model.model_copy(update=update)


def _solve(rows: list[list[float]], values: list[float], basis: Sequence[str]) -> tuple[dict[str, float], float]:
    """Least-squares coefficients (rounded to 1/1000 of a byte) and the largest absolute residual."""
    a, b = np.asarray(rows, dtype=np.float64), np.asarray(values, dtype=np.float64)
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    rounded = np.round(coef, 3)
    residual = float(np.max(np.abs(a @ rounded - b))) if len(b) else 0.0
    return {w: float(c) for w, c in zip(basis, rounded, strict=True) if c != 0.0}, residual


def fit_block(family: str, block_kind: str, *, tokens: Sequence[int] = FIT_TOKENS) -> dict[str, Any]:
    """The coefficients of one family's kind of layer, counted at its narrow shapes."""
    video = family in ("wan", "hunyuanvideo")
    basis = VIDEO_BASIS if video else TEXT_BASIS
    shapes = VIDEO_SHAPES if video else TEXT_SHAPES
    lo, hi = min(tokens), max(tokens)
    rows, none, full, text, sample = [], [], [], [], []
    blocks = None
    for shape in shapes:
        spec = shape_spec(family, shape)
        blocks = real_blocks(config_of(spec), block_kind=block_kind)
        counts = stack_counts(blocks, tokens=tokens)
        w = widths(spec)
        rows.append([w[b] for b in basis])
        none.append((counts[(0, hi)] - counts[(0, lo)]) / (hi - lo))
        full.append((counts[(1, hi)] - counts[(1, lo)]) / (hi - lo))
        intercept = counts[(0, lo)] - lo * none[-1]
        if family == "wan":  # cross-attention: what a sample keeps at zero tokens, at T and 2T text tokens
            twice = shape_spec(family, shape, text_tokens=2 * shape.text_tokens)
            counts2 = stack_counts(real_blocks(config_of(twice), block_kind=block_kind), tokens=tokens)
            intercept2 = counts2[(0, lo)] - lo * (counts2[(0, hi)] - counts2[(0, lo)]) / (hi - lo)
            text.append((intercept2 - intercept) / shape.text_tokens)
            sample.append(intercept - shape.text_tokens * text[-1])
        logger.info("%s/%s at %s: none %.1f, full %.1f bytes per token, %d at zero tokens",
                    family, block_kind, shape, none[-1], full[-1], intercept)
    assert blocks is not None
    none_c, none_r = _solve(rows, none, basis)
    full_c, full_r = _solve(rows, full, basis)
    entry: dict[str, Any] = {"class": blocks.class_name, "none": none_c, "full": full_c}
    residual = max(none_r, full_r)
    if text:
        entry["per_text_token"], text_r = _solve(rows, text, basis)
        entry["per_sample"], sample_r = _solve(rows, sample, basis)
        residual = max(residual, text_r, sample_r)
    entry["max_residual_bytes"] = residual
    entry["versions"] = blocks.versions
    return entry


def fit_table(families: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole table of :mod:`costmodel.activation_table`."""
    names = list(families or BLOCK_KINDS)
    return {
        "dtype": "bfloat16",
        "counted_by": "python -m costmodel.profiling.coefficients",
        "tokens": list(FIT_TOKENS),
        "families": {f: {"blocks": {k: fit_block(f, k) for k in BLOCK_KINDS[f]}} for f in names},
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Count every family and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="Table to write (costmodel/presets/activation_bytes.json).")
    parser.add_argument("--families", default="", help="Comma-separated families (default: all).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    table = fit_table([f for f in args.families.split(",") if f] or None)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
