"""Attention over a packed sequence that never crosses a sample boundary.

These kernels run on the head-sharded side of Ulysses: the whole packed sequence (sample after
sample) for some heads. ``causal_1d`` is causal attention inside each sample; ``spatial_2d``
attends among the tokens of one frame; ``temporal_2d`` attends among the frames at one spatial
position; ``full_3d`` attends among all frames x height x width tokens of a clip (non-causal, the
3D video DiTs: Wan, HunyuanVideo). Each sample is a separate ``scaled_dot_product_attention`` call, so no mask ever
lets one sample see another.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812

from executor.layout import SampleShape

AttentionKind = Literal["causal_1d", "spatial_2d", "temporal_2d", "full_3d"]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     samples: tuple[SampleShape, ...], kind: AttentionKind,
                     scale: float | None = None) -> torch.Tensor:
    """Attention of a packed sequence, sample by sample.

    Args:
        q: Queries ``(total_tokens, heads, head_dim)``, samples contiguous and in order.
        k: Keys ``(total_tokens, kv_heads, head_dim)``; ``kv_heads`` divides ``heads`` and query
            head ``j`` attends with key/value head ``j // (heads / kv_heads)`` (grouped-query
            attention, ``enable_gqa`` of ``scaled_dot_product_attention``).
        v: Values, like ``k``.
        samples: The samples of the packed sequence, in order.
        kind: ``causal_1d``, ``spatial_2d``, ``temporal_2d`` or ``full_3d``.
        scale: Factor of ``q k^T`` (default ``1 / sqrt(head_dim)``).

    Returns:
        ``(total_tokens, heads, head_dim)``.
    """
    total = sum(s.tokens for s in samples)
    if q.shape[0] != total:
        raise ValueError(f"packed attention: {q.shape[0]} tokens but the samples hold {total}")
    if k.shape != v.shape or k.shape[0] != total or q.shape[1] % k.shape[1]:
        raise ValueError(f"packed attention: keys {tuple(k.shape)} and values {tuple(v.shape)} do not fit "
                         f"queries {tuple(q.shape)}")
    outs = []
    start = 0
    for shape in samples:
        end = start + shape.tokens
        outs.append(_one_sample(q[start:end], k[start:end], v[start:end], shape, kind, scale))
        start = end
    return torch.cat(outs, dim=0)


def _one_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: SampleShape,
                kind: AttentionKind, scale: float | None) -> torch.Tensor:
    tokens, heads, head_dim = q.shape
    gqa = k.shape[1] != heads
    if kind in ("causal_1d", "full_3d"):
        # (T, h, Dh) -> (1, h, T, Dh): the 4-D layout the fused (flash) kernels take; 3-D inputs
        # fall back to the math kernel, which materialises the T x T scores.
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=kind == "causal_1d", scale=scale,
                                             enable_gqa=gqa)
        return out[0].transpose(0, 1)
    frames, spatial = shape.frames, shape.spatial
    if kind == "spatial_2d":
        # (f, hw, h, Dh) -> (f, h, hw, Dh): batch over frames, attend over positions.
        def to_batch(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(frames, spatial, t.shape[1], head_dim).permute(0, 2, 1, 3)

        out = F.scaled_dot_product_attention(to_batch(q), to_batch(k), to_batch(v), scale=scale, enable_gqa=gqa)
        return out.permute(0, 2, 1, 3).reshape(tokens, heads, head_dim)
    if kind == "temporal_2d":
        # (f, hw, h, Dh) -> (hw, h, f, Dh): batch over positions, attend over frames.
        def to_time(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(frames, spatial, t.shape[1], head_dim).permute(1, 2, 0, 3)

        out = F.scaled_dot_product_attention(to_time(q), to_time(k), to_time(v), scale=scale, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(tokens, heads, head_dim)
    raise ValueError(f"unknown attention kind {kind!r}")
