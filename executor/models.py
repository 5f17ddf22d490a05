"""Small reference models that run under the executor: LLaMA-style 1D, STDiT-style 2D and a
full-3D-attention video DiT (Wan-style: one self-attention over a clip's frames x height x width
tokens, cross-attention to text tokens, MLP).

Both take the rank's local (sequence-sharded) tokens of one micro-batch, an
:class:`~executor.context.SPContext` and one checkpoint policy per sample, and return local
outputs. Attention runs Ulysses (:mod:`executor.ulysses`) around the sample-bounded kernels of
:mod:`executor.attention`; everything else is per token, so it runs on the shard as is.
A group of one rank with all samples is the plain single-process model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from costmodel.specs import LOSS_CHUNK_TOKENS_DEFAULT
from executor.attention import AttentionKind, packed_attention
from executor.checkpointing import run_layers
from executor.chunked_loss import check_chunk_tokens, chunked_token_losses
from executor.context import SPContext
from executor.ring import ring_packed_attention
from executor.ulysses import head_to_seq, qkv_seq_to_head


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """Size of a reference model."""

    num_layers: int = 2
    """Layers ``L`` (2D: spatial+temporal block pairs); policies range over ``0..L``."""
    hidden: int = 32
    """Hidden size."""
    num_heads: int = 4
    """Attention (query) heads; every SP group size must divide it."""
    num_kv_heads: int | None = None
    """Key/value heads of the self-attention (grouped-query attention); ``None``: ``num_heads``.
    A group size must divide them or be a multiple of them (Ulysses then replicates each key/value
    head to the ranks whose query heads use it: :func:`executor.ulysses.qkv_seq_to_head`)."""
    ffn_hidden: int = 64
    """MLP inner size."""
    vocab: int = 64
    """Vocabulary (1D only)."""
    in_channels: int = 4
    """Latent channels per patch, input and output (2D and 3D)."""
    text_tokens: int = 3
    """Text tokens each 3D block cross-attends to (3D only)."""
    joint_text_tokens: int = 0
    """Text tokens per sample in each block's joint self-attention (MMDiT style,
    :class:`executor.joint.JointDiT3D` only; 0 for the other models)."""
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS_DEFAULT
    """Tokens per chunk of the 1D model's loss when it is given targets
    (:func:`executor.chunked_loss.chunked_token_losses`; 0: whole logits), as the planner's
    ``ModelSpec.loss_chunk_tokens`` charges it."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "ffn_hidden", "vocab", "in_channels", "text_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.joint_text_tokens < 0:
            raise ValueError(f"joint_text_tokens must be >= 0, got {self.joint_text_tokens}")
        check_chunk_tokens(self.loss_chunk_tokens)
        if self.hidden % self.num_heads != 0:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must be positive and divide "
                             f"num_heads={self.num_heads}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the self-attention (``num_heads`` without grouped-query attention)."""
        return self.num_kv_heads or self.num_heads


def _rope_tables(positions: torch.Tensor, head_dim: int, like: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` tables ``(tokens, 1, head_dim // 2)`` of the rotary embedding."""
    half = head_dim // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=like.dtype, device=like.device) / half))
    angles = positions.to(device=like.device, dtype=like.dtype)[:, None] * freqs[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``(tokens, heads, head_dim)`` (RoFormer, rotate-half form)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:]], dim=-1)


class SPAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention with Ulysses SP over a packed micro-batch.

    One projection gives, per key/value head, its ``H / H_kv`` query heads, its key and its value
    (per head ``[q | k | v]`` without grouped-query attention), so one all-to-all moves all three
    (:func:`executor.ulysses.qkv_seq_to_head`, which replicates key/value heads past ``H_kv``).
    """

    def __init__(self, config: ModelConfig, kind: AttentionKind, *, rotary: bool) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.hidden // config.num_heads
        self.kind: AttentionKind = kind
        self.rotary = rotary
        self.qkv = nn.Linear(config.hidden, (config.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, h: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """``(local_tokens, hidden)`` -> same shape."""
        tokens = h.shape[0]
        rep = self.num_heads // self.num_kv_heads
        qkv = self.qkv(h).view(tokens, self.num_kv_heads, rep + 2, self.head_dim)
        q, k, v = qkv_seq_to_head(qkv, ctx.layout, ctx.group)
        if self.rotary:
            cos, sin = _rope_tables(ctx.packed_positions(), self.head_dim, q)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if ctx.ring is not None:  # Ulysses x ring: the ring between the all-to-alls (executor.ring)
            if k.shape[1] != q.shape[1]:  # the ring takes a key/value head per query head
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            o = ring_packed_attention(q, k, v, layout=ctx.ring, group=ctx.ring_group, kind=self.kind)
        else:
            o = packed_attention(q, k, v, samples=ctx.layout.samples, kind=self.kind)
        local = head_to_seq(o, ctx.layout, ctx.group)
        return self.out(local.reshape(tokens, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """LLaMA MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.up = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.down = nn.Linear(config.ffn_hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token MLP."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: causal attention + SwiGLU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden)
        self.attn = SPAttention(config, "causal_1d", rotary=True)
        self.mlp_norm = nn.RMSNorm(config.hidden)
        self.mlp = SwiGLU(config)

    def forward(self, h: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """One block on the local tokens."""
        h = h + self.attn(self.attn_norm(h), ctx)
        return h + self.mlp(self.mlp_norm(h))


class Llama1D(nn.Module):
    """LLaMA-style causal language model (token ids in, logits out; with targets, the per-token
    loss computed in chunks, never the whole logits)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, token_ids: torch.Tensor, ctx: SPContext, *, recompute_layers: Sequence[int],
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Local token ids ``(local_tokens,)`` -> logits ``(local_tokens, vocab)``; with ``targets``
        ``(local_tokens,)``, their per-token cross-entropy ``(local_tokens,)`` instead, computed
        ``config.loss_chunk_tokens`` tokens at a time (what :meth:`token_losses` of the logits
        gives, without holding them)."""
        h = self.embed(token_ids)
        h = self.norm(run_layers(list(self.layers), h, ctx, recompute_layers=recompute_layers))
        if targets is None:
            return self.head(h)
        return chunked_token_losses(h, self.head.weight, targets, chunk_tokens=self.config.loss_chunk_tokens)

    @staticmethod
    def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of every local token ``(local_tokens,)``."""
        return F.cross_entropy(logits, targets, reduction="none")


class DiTBlock(nn.Module):
    """Pre-norm transformer block with non-causal attention (spatial or temporal) + GELU MLP."""

    def __init__(self, config: ModelConfig, kind: AttentionKind) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = SPAttention(config, kind, rotary=False)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(nn.Linear(config.hidden, config.ffn_hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(config.ffn_hidden, config.hidden))

    def forward(self, h: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """One block on the local tokens."""
        h = h + self.attn(self.attn_norm(h), ctx)
        return h + self.mlp(self.mlp_norm(h))


class STDiTLayer(nn.Module):
    """One STDiT layer: a spatial block then a temporal block (the checkpoint unit)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.spatial = DiTBlock(config, "spatial_2d")
        self.temporal = DiTBlock(config, "temporal_2d")

    def forward(self, h: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """Spatial then temporal attention on the local tokens."""
        return self.temporal(self.spatial(h, ctx), ctx)


def _sincos(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    half = dim // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=dtype, device=positions.device) / half))
    angles = positions.to(dtype)[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class VideoDiT(nn.Module):
    """A video latent model: patches in, per-patch prediction out (frame-major tokens, frame and
    in-frame position embedded by sin-cos), with ``num_layers`` layers made by ``make_layer``."""

    def __init__(self, config: ModelConfig, make_layer: Callable[[ModelConfig], nn.Module]) -> None:
        super().__init__()
        if config.hidden % 2 != 0:
            raise ValueError(f"hidden={config.hidden} must be even for the sin-cos embedding")
        self.config = config
        self.embed = nn.Linear(config.in_channels, config.hidden)
        self.layers = nn.ModuleList(make_layer(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.in_channels)

    def forward(self, patches: torch.Tensor, ctx: SPContext, *,
                recompute_layers: Sequence[int]) -> torch.Tensor:
        """Local patches ``(local_tokens, in_channels)`` -> ``(local_tokens, in_channels)``."""
        h = self.embed(patches) + self.position_embedding(ctx, patches.dtype)
        h = run_layers(list(self.layers), h, ctx, recompute_layers=recompute_layers)
        return self.head(self.norm(h))

    def position_embedding(self, ctx: SPContext, dtype: torch.dtype) -> torch.Tensor:
        """Sin-cos embedding of every local token's in-frame position plus its frame's."""
        device = self.embed.weight.device
        positions = ctx.local_positions().to(device)
        spatial = ctx.local_spatial().to(device)
        return (_sincos(positions % spatial, self.config.hidden, dtype)
                + _sincos(positions // spatial, self.config.hidden, dtype))

    @staticmethod
    def token_losses(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean squared error over channels of every local token ``(local_tokens,)``."""
        return ((pred - target) ** 2).mean(dim=-1)


class TextCrossAttention(nn.Module):
    """Cross-attention of every local token to the block's text tokens: queries stay sequence-sharded,
    the text's keys and values are whole on every rank, so it needs no communication.

    The reference model's text is a learned sequence shared by all samples (the unconditional
    caption of classifier-free-guidance training); per-sample captions run the same way in the
    diffusers integrations (``executor.integrations.hf_diffusers.PerSampleCrossAttention``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden // config.num_heads
        self.text = nn.Parameter(torch.zeros(config.text_tokens, config.hidden))
        self.q = nn.Linear(config.hidden, config.hidden, bias=False)
        self.kv = nn.Linear(config.hidden, 2 * config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``(local_tokens, hidden)`` -> same shape."""
        tokens = h.shape[0]
        q = self.q(h).view(tokens, self.num_heads, self.head_dim).transpose(0, 1)[None]
        k, v = self.kv(self.text).view(-1, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return self.out(o[0].transpose(0, 1).reshape(tokens, self.num_heads * self.head_dim))


class DiT3DBlock(nn.Module):
    """One 3D DiT block (the checkpoint unit): self-attention over each whole clip (``full_3d``,
    Ulysses over the clip's tokens), cross-attention to the text, GELU MLP; pre-norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = SPAttention(config, "full_3d", rotary=False)
        self.cross_norm = nn.LayerNorm(config.hidden)
        self.cross = TextCrossAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(nn.Linear(config.hidden, config.ffn_hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(config.ffn_hidden, config.hidden))

    def forward(self, h: torch.Tensor, ctx: SPContext) -> torch.Tensor:
        """One block on the local tokens."""
        h = h + self.attn(self.attn_norm(h), ctx)
        h = h + self.cross(self.cross_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class STDiT2D(VideoDiT):
    """STDiT-style video model: each layer a spatial then a temporal block (Open-Sora 1.x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, STDiTLayer)


class DiT3D(VideoDiT):
    """Full-3D-attention video model: each layer one :class:`DiT3DBlock` (Wan 2.x style)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, DiT3DBlock)


def init_weights(model: nn.Module, *, seed: int) -> None:
    """Deterministic small-normal init (same on every rank for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / math.sqrt(p.shape[-1]))
