"""Plain per-sample attention under a sliding window (and gpt-oss' sinks), the reference the ring
tests compare against: written on the whole tensors in one process, no ring, no process group."""

from __future__ import annotations

import math

import torch

from executor.layout import SampleShape
from executor.ring_layout import RingLayout

HEADS, HEAD_DIM = 2, 4
"""Heads and head size of the reference's queries, keys and values."""


def sink_logits() -> torch.Tensor:
    """A sink logit per head (gpt-oss)."""
    return torch.tensor([0.7, -1.3], dtype=torch.float64)


def full_tensors(samples: tuple[SampleShape, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, g)`` of all the samples' tokens ``(T, H, Dh)`` in fp64, ``g`` the output's
    gradient, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(s.tokens for s in samples)
    return tuple(torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(4))


def windowed_reference(samples: tuple[SampleShape, ...], window: int | None, sinks: bool) -> tuple[torch.Tensor, ...]:
    """Output and gradients of q, k, v and the sinks (loss: sum(out * g)) of plain per-sample
    windowed attention; sinks as transformers' gpt-oss joins them (a logit per head concatenated
    to the scores, dropped after the softmax)."""
    q, k, v, g = full_tensors(samples, 0)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    sink = sink_logits().requires_grad_(True)
    outs, start = [], 0
    for s in samples:
        end = start + s.tokens
        scores = torch.einsum("thd,uhd->htu", q[start:end], k[start:end]) / math.sqrt(HEAD_DIM)
        pos = torch.arange(s.tokens)
        seen = pos[None, :] <= pos[:, None]  # (query, key)
        if window is not None:
            seen &= pos[None, :] > pos[:, None] - window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks:
            scores = torch.cat([scores, sink[:, None, None].expand(-1, s.tokens, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :s.tokens]
        outs.append(torch.einsum("htu,uhd->thd", probs, v[start:end]))
        start = end
    out = torch.cat(outs)
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, sink.grad  # type: ignore[return-value]


def local_rows(full: torch.Tensor, layout: RingLayout) -> torch.Tensor:
    """The rows of ``full`` (all samples' tokens) that ``layout``'s rank holds, in its order."""
    offsets = layout.sample_offsets()
    return torch.cat([layout.shard(full[offsets[s]:offsets[s + 1]], s) for s in range(layout.num_samples)])
