"""The profiling sweep's layers from the model's own classes (``dcp profile --model-config``).

The sweep (:mod:`costmodel.profiling.sweep`) calls each layer as ``layer(x, samples, *extras,
group_size)`` on a packed micro-batch ``x`` of ``(tokens, hidden)``. :class:`RealLayer` runs the
model's own block (:mod:`costmodel.profiling.real_classes`) on each sample of the pack in turn,
so that attention stays inside its sample, with the block's own inputs for a sample of that many
tokens (rotary tables from the model's rotary module; a video block's text states and timestep
embedding, made once per sample size and reused); the sweep's look-alike extras are not used.

Real classes run whole samples: one rank of a group of one (``group_size=1``); the look-alike
blocks emulate a rank's share of larger groups. :func:`layer_factory` returns the sweep's layer
factory for a config, or None with the reason when its class cannot be imported: the caller
then profiles the look-alike blocks of :mod:`costmodel.profiling.blocks` and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from costmodel.profiling.blocks import SampleShape
from costmodel.profiling.module_count import default_dtype
from costmodel.profiling.real_classes import BlockInputs, NoRealClassError, RealBlocks, real_blocks
from costmodel.profiling.sweep import LayerFactory
from costmodel.specs import ModelSpec

logger = logging.getLogger(__name__)


class RealLayer(nn.Module):
    """One real block called the sweep's way (see the module docstring)."""

    def __init__(self, blocks: RealBlocks, index: int) -> None:
        super().__init__()
        self.block = blocks.factory(index)
        self._blocks = blocks
        self._inputs: dict[tuple[int, torch.device, torch.dtype], BlockInputs] = {}

    def _sample_inputs(self, tokens: int, like: torch.Tensor) -> BlockInputs:
        key = (tokens, like.device, like.dtype)
        if key not in self._inputs:
            generator = torch.Generator().manual_seed(tokens)
            self._inputs[key] = self._blocks.make_inputs(tokens, device=like.device, dtype=like.dtype,
                                                         generator=generator)
        return self._inputs[key]

    def forward(self, x: torch.Tensor, samples: Sequence[SampleShape], *extras: Any) -> torch.Tensor:
        group_size = extras[-1] if extras else 1
        if group_size != 1:
            raise ValueError(f"group_size={group_size}: the real layer classes run whole samples (group size 1)")
        outs, start = [], 0
        for frames, per_frame in samples:
            tokens = frames * per_frame
            inputs = self._sample_inputs(tokens, x)
            state = (x[start:start + tokens][None], *inputs.state[1:])
            outs.append(self._blocks.call(self.block, state, inputs.context)[0][0])
            start += tokens
        return torch.cat(outs)


def layer_factory(config: Mapping[str, Any] | None, *, profiled: ModelSpec) -> tuple[LayerFactory | None, str]:
    """The sweep's factory of the config's real blocks, and a note on what is profiled.

    Args:
        config: The ``config.json`` object (None: no config, the look-alike blocks).
        profiled: The shape that runs (its width replaces the config's when narrowed).

    Returns:
        ``(factory, note)``; ``factory`` is None when the class cannot be imported (the note
        says why and that the look-alike block stands in).
    """
    if config is None:
        return None, "look-alike blocks (costmodel/profiling/blocks.py): no model config"
    try:
        from costmodel.profiling.real_classes import config_of

        data = config if profiled.family is None else {**config_of(profiled), **_keep(config, profiled)}
        blocks = real_blocks(data)
    except NoRealClassError as exc:
        note = f"look-alike blocks (costmodel/profiling/blocks.py) instead of the model's class: {exc}"
        logger.warning(note)
        return None, note
    if blocks.family == "hunyuanvideo":
        note_kind = " (dual-stream blocks; the single-stream ones are counted by costmodel.profiling.coefficients)"
    else:
        note_kind = ""
    versions = ", ".join(f"{k} {v}" for k, v in blocks.versions.items())
    note = f"real layer class {blocks.class_name}{note_kind} ({versions})"

    def factory(spec: ModelSpec, num_layers: int, *, device: torch.device, dtype: torch.dtype) -> nn.ModuleList:
        with default_dtype(dtype):
            layers = nn.ModuleList([RealLayer(blocks, i) for i in range(num_layers)])
        return layers.to(device=device, dtype=dtype)

    return factory, note


def _keep(config: Mapping[str, Any], profiled: ModelSpec) -> dict[str, Any]:
    """The config's fields that do not set a width (norm epsilon, rotary base, qk norm): kept
    when the profiled shape is narrowed."""
    widths = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "num_hidden_layers", "num_layers", "num_single_layers", "attention_head_dim", "ffn_dim", "mlp_ratio",
              "vocab_size", "rope_axes_dim"}
    return {k: v for k, v in config.items() if k not in widths}
