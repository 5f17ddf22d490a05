"""MMDiT-style joint attention under Ulysses, and a full-3D video DiT built on it.

In a joint-attention (MMDiT) block each sample's ``J`` text tokens join its clip's ``n`` tokens in
one non-causal self-attention over ``J + n`` tokens, and the text tokens carry a stream of their
own (own norms, projections and MLP) from block to block (Esser et al. 2024, SD3, arXiv:2403.03206,
Sec. 4; HunyuanVideo's dual-stream blocks, Kong et al. 2024, arXiv:2412.03603). The last block is
*context-pre-only* as in SD3: its text tokens give keys and values only, since no later block
reads the text stream.

The Ulysses scheme (the one head-sliced "joint tensors" of USP-based DiT engines use, Fang et al.
2024, xDiT, arXiv:2411.01738):

- The clip's tokens are sequence-sharded over the group's ``d`` ranks as everywhere in the
  executor; one fused all-to-all (:func:`executor.ulysses.qkv_seq_to_head`) gives each rank every
  clip token of the micro-batch for its query heads (and the key/value heads they use).
- A sample's text tokens are few and *whole on every rank* of its group (replicated, never
  sharded). Each rank projects them and keeps the same exchange units (query heads with their
  key/value head, replicated past ``H_kv`` exactly as the clip's) it received for the clip, so
  no text travels before attention.
- Per sample and per local head, attention runs over ``[text; clip]``: queries of both, keys and
  values of both. This is exactly the unsplit joint attention restricted to those heads, since
  heads never mix inside attention.
- The clip's output goes back with the usual all-to-all (:func:`executor.ulysses.head_to_seq`);
  the text's output ``(J, H/d, Dh)`` is all-gathered over the group along the heads
  (:class:`_GatherHeads`) so that every rank again holds the whole text stream and runs its
  output projection and MLP.

Gradients: every rank's text replica feeds only its own heads, so the replicas' parameter
gradients add up (in the step's world sum) to the plain model's; the gather's backward is the
transpose of the gather (an all-reduce of the output's gradient over the group, then this rank's
heads), so the text stream before the gather receives every rank's contribution. Cost: each
rank of a group projects the ``J`` text tokens and runs the text stream's MLP for the sample
itself (``J`` tokens, not ``J/d``), and the gather moves ``J * hidden`` values per sample and
block; both are per sample, whatever the clip's length.

Layout of the hidden states a :class:`JointDiT3DBlock` takes: the rank's local clip tokens
(sample after sample), then the text tokens of every sample of the micro-batch (``J`` rows each,
sample after sample); :func:`executor.checkpointing.run_layers` keeps both with ``extra_rows=J``,
so a sample's text rows are checkpointed with its clip under its own policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

from executor.checkpointing import run_layers
from executor.context import SPContext
from executor.models import ModelConfig, VideoDiT
from executor.ulysses import EmulatedGroup, Group, head_to_seq, qkv_seq_to_head, qkv_units, split_units


class _GatherHeads(torch.autograd.Function):
    """All-gather ``(N, h, Dh)`` over a group along the heads; backward: all-reduce, own heads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, index: int) -> torch.Tensor:
        ctx.group, ctx.index, ctx.heads = group, index, x.shape[1]
        if isinstance(group, EmulatedGroup):  # one rank's share: this rank's heads stand in
            return x.repeat(1, group.size, 1)
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grads[0].contiguous().clone()
        if not isinstance(ctx.group, EmulatedGroup):
            dist.all_reduce(grad, group=ctx.group)
        h = ctx.heads
        return grad[:, ctx.index * h:(ctx.index + 1) * h].contiguous(), None, None


def gather_heads(x: torch.Tensor, group: Group, index: int) -> torch.Tensor:
    """The whole ``(N, H, Dh)`` on every rank of a group from each rank's ``(N, H/d, Dh)`` heads
    (rank ``index`` holds the ``index``-th block of heads, as :func:`executor.ulysses.seq_to_head`
    gives them); backward: the gradient all-reduced over the group, then this rank's heads."""
    out = _GatherHeads.apply(x, group, index)
    assert isinstance(out, torch.Tensor)
    return out


def _bhsd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(J, h, Dh)`` and ``(n, h, Dh)`` -> ``(1, h, J + n, Dh)``, the layout of the fused kernels."""
    return torch.cat([a, b]).transpose(0, 1)[None]


def joint_attention(clip_qkv: torch.Tensor, text_qkv: torch.Tensor, ctx: SPContext, *, text_tokens: int,
                    text_queries: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per sample, attention over its text tokens and its whole clip (non-causal), Ulysses-sharded.

    Args:
        clip_qkv: This rank's clip tokens ``(local_tokens, H_kv, r + 2, Dh)`` (the layout of
            :func:`executor.ulysses.qkv_seq_to_head`).
        text_qkv: Every sample's text tokens, whole, ``(samples * J, H_kv, r + 2, Dh)``.
        ctx: The micro-batch context (a pure Ulysses group).
        text_tokens: ``J``, text tokens per sample.
        text_queries: Whether the text tokens query too (``False``: the context-pre-only last
            block, where they give keys and values only).

    Returns:
        The clip's attention output ``(local_tokens, H, Dh)`` and the text's ``(samples * J, H, Dh)``
        (whole on every rank of the group), or ``None`` without ``text_queries``.

    Raises:
        ValueError: when the text rows do not match the samples, or the group is a ring.
    """
    layout = ctx.layout
    if ctx.ring is not None:
        raise ValueError("joint attention runs on pure Ulysses groups only (ring_degree=1), got a ring of "
                         f"{ctx.ring.ring_degree}")
    if text_tokens <= 0 or text_qkv.shape[0] != layout.num_samples * text_tokens:
        raise ValueError(f"joint attention: {text_qkv.shape[0]} text rows for {layout.num_samples} samples of "
                         f"{text_tokens} text tokens")
    d, index = layout.group_size, layout.index_in_group
    q, k, v = qkv_seq_to_head(clip_qkv, layout, ctx.group)
    units = qkv_units(text_qkv, group_size=d)
    mine = units.shape[1] // d  # this rank's exchange units: the heads of its clip queries
    tq, tk, tv = split_units(units[:, index * mine:(index + 1) * mine])
    gqa = k.shape[1] != q.shape[1]
    clip_out, text_out = [], []
    start = 0
    for s, shape in enumerate(layout.samples):
        end, t0, t1 = start + shape.tokens, s * text_tokens, (s + 1) * text_tokens
        keys, values = _bhsd(tk[t0:t1], k[start:end]), _bhsd(tv[t0:t1], v[start:end])
        if text_queries:
            o = F.scaled_dot_product_attention(_bhsd(tq[t0:t1], q[start:end]), keys, values, enable_gqa=gqa)
            o = o[0].transpose(0, 1)
            text_out.append(o[:text_tokens])
            clip_out.append(o[text_tokens:])
        else:
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], keys, values, enable_gqa=gqa)
            clip_out.append(o[0].transpose(0, 1))
        start = end
    clip = head_to_seq(torch.cat(clip_out), layout, ctx.group)
    if not text_queries:
        return clip, None
    text = torch.cat(text_out)
    if d > 1:
        assert ctx.group is not None
        text = gather_heads(text, ctx.group, index)
    return clip, text


def _mlp(config: ModelConfig) -> nn.Sequential:
    return nn.Sequential(nn.Linear(config.hidden, config.ffn_hidden), nn.GELU(approximate="tanh"),
                         nn.Linear(config.ffn_hidden, config.hidden))


class JointAttention(nn.Module):
    """The joint self-attention of one block: the clip's and the text's own projections.

    Both fused projections give, per key/value head, its ``H / H_kv`` query heads, its key and its
    value (the layout of :class:`executor.models.SPAttention`). A context-pre-only attention
    (``text_out=False``) has no text output projection.
    """

    def __init__(self, config: ModelConfig, *, text_out: bool = True) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.kv_heads
        self.head_dim = config.hidden // config.num_heads
        width = (config.num_heads + 2 * config.kv_heads) * self.head_dim
        self.qkv = nn.Linear(config.hidden, width, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)
        self.text_qkv = nn.Linear(config.hidden, width, bias=False)
        self.text_out = nn.Linear(config.hidden, config.hidden, bias=False) if text_out else None

    def forward(self, clip: torch.Tensor, text: torch.Tensor, ctx: SPContext, *, text_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(local_tokens, hidden)`` and ``(samples * J, hidden)`` -> the same shapes (the text's
        ``None`` in a context-pre-only block)."""
        rep = self.num_heads // self.num_kv_heads

        def fused(x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(x.shape[0], self.num_kv_heads, rep + 2, self.head_dim)

        co, to = joint_attention(fused(clip, self.qkv), fused(text, self.text_qkv), ctx, text_tokens=text_tokens,
                                 text_queries=self.text_out is not None)
        width = self.num_heads * self.head_dim
        clip_out = self.out(co.reshape(clip.shape[0], width))
        if self.text_out is None or to is None:
            return clip_out, None
        return clip_out, self.text_out(to.reshape(text.shape[0], width))


class JointDiT3DBlock(nn.Module):
    """One MMDiT-style block (the checkpoint unit): joint attention, then each stream's MLP; pre-norm.

    ``context_pre_only``: the last block's text gives keys and values only (no text output, MLP or
    their norms), as SD3's last block; its text rows pass through unchanged.
    """

    def __init__(self, config: ModelConfig, *, context_pre_only: bool = False) -> None:
        super().__init__()
        self.text_tokens = config.joint_text_tokens
        self.context_pre_only = context_pre_only
        self.attn_norm, self.text_attn_norm = nn.LayerNorm(config.hidden), nn.LayerNorm(config.hidden)
        self.attn = JointAttention(config, text_out=not context_pre_only)
        self.mlp_norm, self.mlp = nn.LayerNorm(config.hidden), _mlp(config)
        if not context_pre_only:
            self.text_mlp_norm, self.text_mlp = nn.LayerNorm(config.hidden), _mlp(config)

    def forward(self, h: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """Local clip tokens then the micro-batch's text tokens (module docstring) -> the same."""
        local = ctx.layout.local_tokens
        if h.shape[0] != local + ctx.layout.num_samples * self.text_tokens:
            raise ValueError(f"joint block: {h.shape[0]} rows, expected {local} local clip tokens + "
                             f"{ctx.layout.num_samples} x {self.text_tokens} text tokens")
        clip, text = h[:local], h[local:]
        co, to = self.attn(self.attn_norm(clip), self.text_attn_norm(text), ctx, text_tokens=self.text_tokens)
        clip = clip + co
        clip = clip + self.mlp(self.mlp_norm(clip))
        if to is not None:
            text = text + to
            text = text + self.text_mlp(self.text_mlp_norm(text))
        return torch.cat([clip, text])


class JointDiT3D(VideoDiT):
    """Full-3D-attention video model with MMDiT-style joint text attention: each layer one
    :class:`JointDiT3DBlock` (the last context-pre-only); every sample's text stream starts from
    the same learned ``joint_text_tokens`` x ``hidden`` sequence (the unconditional caption, as in
    :class:`executor.models.TextCrossAttention`)."""

    def __init__(self, config: ModelConfig) -> None:
        if config.joint_text_tokens <= 0:
            raise ValueError(f"JointDiT3D needs joint_text_tokens > 0, got {config.joint_text_tokens}")
        super().__init__(config, JointDiT3DBlock)
        self.layers[-1] = JointDiT3DBlock(config, context_pre_only=True)
        self.text = nn.Parameter(torch.zeros(config.joint_text_tokens, config.hidden))

    def forward(self, patches: torch.Tensor, ctx: SPContext, *,
                recompute_layers: Sequence[int]) -> torch.Tensor:
        """Local patches ``(local_tokens, in_channels)`` -> ``(local_tokens, in_channels)``."""
        h = self.embed(patches) + self.position_embedding(ctx, patches.dtype)
        text = self.text.repeat(ctx.layout.num_samples, 1)
        h = run_layers(list(self.layers), torch.cat([h, text]), ctx, recompute_layers=recompute_layers,
                       extra_rows=self.config.joint_text_tokens)
        return self.head(self.norm(h[:ctx.layout.local_tokens]))
