"""Look-alike torch transformer blocks with the shapes of the models we plan for.

They stand in for a model's own layer class (:mod:`costmodel.profiling.real_classes`) where none
is given or importable: ``dcp profile --model PRESET`` (and ``--look-alike``), and a
``--model-config`` whose class cannot be imported (the profile says so). They emulate one rank's
share of a Ulysses group of any size; what they save for backward is not what the real classes
save (no fp32 norm copies: docs/cost-model.md).

A micro-batch is *packed*: the samples' tokens are concatenated into one ``(tokens, hidden)``
tensor and ``samples`` gives each sample's ``(frames, tokens_per_frame)``. Position-wise parts
(linear layers, norms, MLP) run on the whole packed tensor; attention runs per sample, so that
no token attends across a sample boundary (what varlen flash attention does on a GPU).

With ``group_size=d > 1`` a layer runs what *one rank* of a Ulysses group of ``d`` runs: the
packed tensor holds the rank's ``s/d`` tokens of every sample, and around attention the
all-to-all is replaced by a local copy with the same layout (:func:`emulated_seq_to_head`):
the rank then attends over every whole sample for ``1/d`` of the heads, as in training, and only
the communication is left out (it is profiled on its own by ``dcp profile-comm``).

* :class:`LlamaLayer` (1D): RMSNorm, rotary positions restarting at every sample, causal SDPA
  with grouped KV heads, SwiGLU MLP (LLaMA).
* :class:`STDiTLayer` (2D): a spatial block (attention inside each frame) then a temporal block
  (attention across the frames at each position), each with adaLN-style modulation from a
  per-sample conditioning vector, cross-attention to a few text tokens and a GELU MLP (STDiT).
* :class:`LlamaHead` / :class:`DiTHead`: what surrounds the layers (embeddings, output
  projection, loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from costmodel.specs import ModelSpec

SampleShape = tuple[int, int]  # (frames, tokens per frame)


def _offsets(samples: Sequence[SampleShape], group_size: int = 1) -> list[tuple[int, int]]:
    out, start = [], 0
    for frames, spatial in samples:
        size = frames * spatial // group_size
        out.append((start, start + size))
        start += size
    return out


def check_divisible(samples: Sequence[SampleShape], group_size: int) -> None:
    """Each sample must split evenly over the group for the emulated all-to-all.

    Raises:
        ValueError: naming the first sample whose tokens ``group_size`` does not divide.
    """
    for frames, spatial in samples:
        if (frames * spatial) % group_size:
            raise ValueError(f"sample [{frames}, {spatial}] has {frames * spatial} tokens, not a "
                             f"multiple of group_size={group_size}")


def emulated_seq_to_head(t: torch.Tensor, samples: Sequence[SampleShape], group_size: int
                         ) -> torch.Tensor:
    """``(local tokens, H, X)`` -> ``(all tokens, H/d, X)`` with the layout of a Ulysses all-to-all.

    A real all-to-all receives the other ranks' tokens for this rank's heads; here the rank's own
    tokens for the other heads stand in for them: same shapes, same copies, no communication.
    """
    d = group_size
    if d == 1:
        return t
    heads, width = t.shape[1], t.shape[2]
    out = []
    for start, end in _offsets(samples, d):
        piece = t[start:end]
        out.append(piece.reshape(end - start, d, heads // d, width).transpose(0, 1)
                   .reshape((end - start) * d, heads // d, width))
    return torch.cat(out)


def emulated_head_to_seq(t: torch.Tensor, samples: Sequence[SampleShape], group_size: int
                         ) -> torch.Tensor:
    """Inverse of :func:`emulated_seq_to_head`: ``(all tokens, H/d, X)`` -> ``(local, H*X)``."""
    d = group_size
    heads_local, width = t.shape[1], t.shape[2]
    if d == 1:
        return t.reshape(t.shape[0], heads_local * width)
    out, start = [], 0
    for frames, spatial in samples:
        total = frames * spatial
        piece = t[start:start + total]
        start += total
        out.append(piece.reshape(d, total // d, heads_local, width).transpose(0, 1)
                   .reshape(total // d, d * heads_local * width))
    return torch.cat(out)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (LLaMA)."""

    def __init__(self, hidden: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels: ``x`` is ``(tokens, heads, head_dim)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LlamaLayer(nn.Module):
    """One LLaMA decoder layer on a packed 1D micro-batch."""

    def __init__(self, spec: ModelSpec, *, rope_base: float = 10000.0) -> None:
        super().__init__()
        h = spec.hidden
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.kv_heads
        self.head_dim = h // spec.num_heads
        kv = self.num_kv_heads * self.head_dim
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, h + 2 * kv, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * spec.ffn_hidden, bias=False)
        self.down = nn.Linear(spec.ffn_hidden, h, bias=False)
        inv_freq = 1.0 / rope_base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope_tables(self, samples: Sequence[SampleShape], x: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions restart at 0 for every packed sample. Tables are built per layer so that the
        # kept activations are exactly per layer.
        pos = torch.cat([torch.arange(f * hw, device=x.device) for f, hw in samples]).float()
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        angles = torch.outer(pos, inv_freq.to(x.device))[:, None, :]
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def forward(self, x: torch.Tensor, samples: Sequence[SampleShape], group_size: int = 1) -> torch.Tensor:
        tokens = x.shape[0]
        d = group_size
        hd, nq, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv(self.attn_norm(x)).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(tokens, nq, hd), k.view(tokens, nkv, hd), v.view(tokens, nkv, hd)
        if d > 1 and nkv % d:  # past the KV heads each is replicated to the d / nkv ranks that use it,
            k, v = (t.repeat_interleave(d // nkv, dim=1) for t in (k, v))  # as executor/ulysses.py does
        q, k, v = (emulated_seq_to_head(t, samples, d) for t in (q, k, v))
        cos, sin = self._rope_tables(samples, x)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        outs = []
        for start, end in _offsets(samples):
            # (1, heads, s, hd): the 4-D layout the fused (flash) kernels take.
            outs.append(F.scaled_dot_product_attention(
                q[None, start:end].transpose(1, 2), k[None, start:end].transpose(1, 2),
                v[None, start:end].transpose(1, 2), is_causal=True,
                enable_gqa=k.shape[1] != q.shape[1],
            ).transpose(1, 2)[0])
        # Always a fresh tensor (also for one sample) so that the kept bytes are per token.
        x = x + self.out(emulated_head_to_seq(torch.cat(outs), samples, d).contiguous())
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class _DiTBlock(nn.Module):
    """adaLN-modulated self-attention (spatial, temporal, or over the whole clip: ``full``),
    cross-attention, GELU MLP."""

    def __init__(self, spec: ModelSpec, *, temporal: bool = False, full: bool = False) -> None:
        super().__init__()
        h = spec.hidden
        self.temporal = temporal
        self.full = full
        self.num_heads = spec.num_heads
        self.head_dim = h // spec.num_heads
        self.modulation = nn.Linear(h, 6 * h)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.cross_q = nn.Linear(h, h)
        self.cross_kv = nn.Linear(h, 2 * h)
        self.cross_out = nn.Linear(h, h)
        self.fc1 = nn.Linear(h, spec.ffn_hidden)
        self.fc2 = nn.Linear(spec.ffn_hidden, h)

    def _self_attention(self, x: torch.Tensor, frames: int, spatial: int, group_size: int) -> torch.Tensor:
        nh, hd = self.num_heads, self.head_dim
        tokens = x.shape[0]
        # (local, heads, 3*hd): one all-to-all moves q, k and v of this rank's tokens.
        qkv = self.qkv(x).view(tokens, 3, nh, hd).transpose(1, 2).reshape(tokens, nh, 3 * hd)
        qkv = emulated_seq_to_head(qkv, [(frames, spatial)], group_size)
        heads = qkv.shape[1]
        qkv = qkv.view(1, frames * spatial, heads, 3, hd) if self.full else qkv.view(frames, spatial, heads, 3, hd)
        if self.temporal:  # attend across frames at each position: batch = positions
            qkv = qkv.transpose(0, 1)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # (batch, heads, seq, hd)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # (batch, seq, heads, hd)
        if self.temporal:
            o = o.transpose(0, 1)
        o = o.reshape(frames * spatial, heads, hd)
        return self.out(emulated_head_to_seq(o, [(frames, spatial)], group_size).contiguous())

    def _cross_attention(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        h, nh, hd = x.shape[-1], self.num_heads, self.head_dim
        q = self.cross_q(x).view(1, -1, nh, hd).transpose(1, 2)
        k, v = self.cross_kv(text).view(1, -1, 2, nh, hd).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, h)
        return self.cross_out(o)

    def forward(self, x: torch.Tensor, samples: Sequence[SampleShape], cond: torch.Tensor,
                text: torch.Tensor, group_size: int = 1) -> torch.Tensor:
        outs = []
        offsets = _offsets(samples, group_size)
        for i, ((start, end), (frames, spatial)) in enumerate(zip(offsets, samples, strict=True)):
            xs = x[start:end]
            shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(cond[i]).chunk(6)
            y = F.layer_norm(xs, (xs.shape[-1],)) * (1 + scale1) + shift1
            xs = xs + gate1 * self._self_attention(y, frames, spatial, group_size)
            if text.shape[1] > 0:
                xs = xs + self._cross_attention(xs, text[i])
            y = F.layer_norm(xs, (xs.shape[-1],)) * (1 + scale2) + shift2
            xs = xs + gate2 * self.fc2(F.gelu(self.fc1(y), approximate="tanh"))
            outs.append(xs)
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class STDiTLayer(nn.Module):
    """One STDiT layer: a spatial block then a temporal block."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spatial = _DiTBlock(spec, temporal=False)
        self.temporal = _DiTBlock(spec, temporal=True)

    def forward(self, x: torch.Tensor, samples: Sequence[SampleShape], cond: torch.Tensor,
                text: torch.Tensor, group_size: int = 1) -> torch.Tensor:
        spatial = self.spatial(x, samples, cond, text, group_size)
        return self.temporal(spatial, samples, cond, text, group_size)


class DiT3DLayer(nn.Module):
    """One 3D DiT layer (Wan 2.x style): one block whose self-attention spans the whole clip."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.block = _DiTBlock(spec, full=True)

    def forward(self, x: torch.Tensor, samples: Sequence[SampleShape], cond: torch.Tensor,
                text: torch.Tensor, group_size: int = 1) -> torch.Tensor:
        return self.block(x, samples, cond, text, group_size)


class LlamaHead(nn.Module):
    """Embedding lookup, final norm, output projection and cross-entropy (1D)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.norm = RMSNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(token_ids)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float(), token_ids.roll(-1))


class DiTHead(nn.Module):
    """Patch embedding in, final projection out and a diffusion MSE loss (2D, 2x2 patches, 4 ch)."""

    def __init__(self, spec: ModelSpec, *, patch_channels: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(patch_channels, spec.hidden)
        self.final = nn.Linear(spec.hidden, 2 * patch_channels)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        out = self.final(F.layer_norm(self.embed(patches), (self.embed.out_features,)))
        return F.mse_loss(out.float()[:, : patches.shape[1]], patches.float())


def build_layers(spec: ModelSpec, num_layers: int, *, device: torch.device, dtype: torch.dtype
                 ) -> nn.ModuleList:
    """``num_layers`` layers of the model's kind, in ``dtype`` on ``device``."""
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    layer_cls = {"1d": LlamaLayer, "2d": STDiTLayer, "3d": DiT3DLayer}[spec.kind]
    layers = nn.ModuleList([layer_cls(spec) for _ in range(num_layers)])
    return layers.to(device=device, dtype=dtype)


def build_head(spec: ModelSpec, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The head of the model's kind, in ``dtype`` on ``device``."""
    if spec.kind == "1d" and spec.vocab <= 0:
        raise ValueError(f"model {spec.name!r}: a 1D head needs vocab > 0, got {spec.vocab}")
    head: nn.Module = LlamaHead(spec) if spec.kind == "1d" else DiTHead(spec)
    return head.to(device=device, dtype=dtype)
