"""What the diffusers video integrations share (:mod:`hf_diffusers` for Latte, :mod:`hf_wan`,
:mod:`hf_hunyuan`): the heads check, patchifying a target the way a model unpatchifies its
output, and embedding each clip whole, then keeping this rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from executor.context import SPContext


def check_heads(model: nn.Module, *, group_sizes: Iterable[int], supports: str) -> None:
    """Every group size must divide the model's attention heads (Ulysses shards heads; for Ulysses x
    ring groups give their Ulysses degrees, ``GroupRegistry.ulysses_degrees``).

    Args:
        model: A diffusers model whose ``config`` has ``num_attention_heads``.
        group_sizes: The group sizes (Ulysses degrees) the model will run on.
        supports: The model class the integration supports, named when ``model`` has no heads.

    Raises:
        ValueError: naming the heads and the sizes they do not divide.
    """
    config: Any = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_attention_heads"):
        raise ValueError(f"the model has no config.num_attention_heads: this integration supports {supports}")
    heads = int(config.num_attention_heads)
    bad = sorted(d for d in set(group_sizes) if heads % d)
    if bad:
        raise ValueError(f"num_attention_heads={heads} is not divisible by group sizes {bad}: allow only "
                         f"sizes that divide {heads}")


def patchify(video: torch.Tensor, patch_size: Sequence[int], *, channels_first: bool) -> torch.Tensor:
    """``(C, F, H, W)`` -> ``(f*h*w, values)``: one row per patch, its values ordered
    ``(p_t, p_h, p_w, C)`` or, with ``channels_first``, ``(C, p_t, p_h, p_w)`` (the order of the
    model's own unpatchify: Wan the first, HunyuanVideo the second)."""
    channels, frames, height, width = video.shape
    p_t, p_h, p_w = patch_size
    f, h, w = frames // p_t, height // p_h, width // p_w
    x = video.reshape(channels, f, p_t, h, p_h, w, p_w)
    order = (1, 3, 5, 0, 2, 4, 6) if channels_first else (1, 3, 5, 2, 4, 6, 0)
    return x.permute(*order).reshape(f * h * w, p_t * p_h * p_w * channels)


def embed_and_shard(videos: Sequence[torch.Tensor], ctx: SPContext, *,
                    embed: Callable[[torch.Tensor], torch.Tensor],
                    rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample's patch embedding and rotary tables, this rank's tokens of them, concatenated.

    Args:
        videos: Each sample's latent video ``(C, F, H, W)``.
        ctx: The micro-batch context (cuts each whole sample, :meth:`SPContext.shard`).
        embed: The model's patch embedding of one video: ``(n, D)``.
        rope: The model's rotary tables of one video: cos and sin, ``n`` rows each.

    Raises:
        ValueError: when a video's patches are not the plan's tokens of its sample.
    """
    parts, cos_parts, sin_parts = [], [], []
    for s, video in enumerate(videos):
        tokens = embed(video)
        planned = ctx.placement.samples[s].tokens
        if tokens.shape[0] != planned:
            raise ValueError(f"sample {s}: {tokens.shape[0]} patches, the plan has {planned}")
        cos, sin = rope(video)
        parts.append(ctx.shard(tokens, s))
        cos_parts.append(ctx.shard(cos, s))
        sin_parts.append(ctx.shard(sin, s))
    return torch.cat(parts), torch.cat(cos_parts), torch.cat(sin_parts)
