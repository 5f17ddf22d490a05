"""DCP on an unmodified ``diffusers`` Wan 2.x video transformer (full 3D attention).

``WanTransformer3DModel.forward`` patchifies one dense ``(B, C, F, H, W)`` batch of equal-shaped
videos, so it cannot take a rank's shard of a packed micro-batch of differently shaped clips. The
model's modules are used unchanged; what plugs in:

- Attention processors (``Attention.set_processor``, diffusers' own mechanism): every block's
  self-attention runs :class:`UlyssesWanSelfAttention` (q/k RMS norm across heads and the 3D
  rotary embedding on the local tokens, one fused q/k/v all-to-all, attention over each whole
  clip: ``full_3d``, and back; in a Ulysses x ring group, ``GroupPlan.ring_degree > 1``, the
  all-to-all runs over the ``u`` ranks of the rank's ring position and the non-causal attention
  goes round the ring, :func:`executor.ring.ring_packed_attention`); cross-attention runs
  :class:`PerSampleWanCrossAttention` (local queries against their own sample's text keys and
  values, no communication, whatever the layout: the ring applies to self-attention only).
- :func:`forward`: the model's forward step for step (3D patch embedding, rotary tables, time and
  text embedding, blocks, output modulation and projection) on the rank's local tokens as one
  sequence, with the blocks' per-token modulation (the ``(B, T, 6, D)`` form Wan 2.2 uses), so each
  token gets its own sample's timestep; each sample's checkpoint policy recomputes its first
  ``k`` blocks. Patches and rotary tables are cut by ``SPContext.shard``, so in a ring group each
  rank embeds its zig-zag chunks with their own 3D positions.

Usage (per micro-batch; ``videos``, ``timesteps``, ``texts`` of the micro-batch's samples)::

    hf_wan.prepare(model, group_sizes=registry.ulysses_degrees)
    pred = hf_wan.forward(model, work, videos=videos, timesteps=timesteps, texts=texts)
    work.loss(hf_wan.token_losses(pred, work.targets)).backward()

Wan's ``FP32LayerNorm`` and modulation run in fp32 whatever the model's dtype (the model's own
choice): in fp64 a step's loss and most gradients equal the plain model's to fp64 rounding, those
Wan rounds or sums in fp32 on each rank (its ``_keep_in_fp32_modules`` and ``time_proj``) to fp32
rounding. Limits: text-to-video (no image conditioning), no attention masks.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from executor.attention import packed_attention
from executor.checkpointing import run_split_by_policy, validate_policies
from executor.context import SPContext
from executor.integrations import clips
from executor.ring import ring_packed_attention
from executor.runtime import MicroBatchWork
from executor.ulysses import head_to_seq, seq_to_head

_CTX: contextvars.ContextVar[SPContext | None] = contextvars.ContextVar("dcp_wan_ctx", default=None)
"""The micro-batch's SP context while a block runs (Wan's blocks pass no kwargs to processors)."""


def _ctx(where: str) -> SPContext:
    ctx = _CTX.get()
    if ctx is None:
        raise ValueError(f"{where}: DCP's Wan processors run inside hf_wan.forward(model, work, ...)")
    return ctx


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding (interleaved pairs) of ``(T, heads, Dh)`` with per-token tables
    ``(T, 1, Dh)``: the same arithmetic as its processor's ``apply_rotary_emb``."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesWanSelfAttention:
    """A block's self-attention under Ulysses SP (or Ulysses x ring), over each whole clip."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> torch.Tensor:
        ctx = _ctx("self-attention")
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("DCP's Wan self-attention takes no mask and no encoder states")
        x = hidden_states[0]  # (T, D): the local tokens (one padding token on a rank without any)
        tokens, pad = x.shape[0], x.shape[0] - ctx.layout.local_tokens
        heads = attn.heads
        q = attn.norm_q(attn.to_q(x)).unflatten(-1, (heads, -1))
        k = attn.norm_k(attn.to_k(x)).unflatten(-1, (heads, -1))
        v = attn.to_v(x).unflatten(-1, (heads, -1))
        cos, sin = rotary_emb
        q, k = _rope(q, cos[0], sin[0]), _rope(k, cos[0], sin[0])
        local = ctx.layout.local_tokens
        head_dim = q.shape[-1]
        fused = torch.cat([q[:local], k[:local], v[:local]], dim=-1)  # (T, H, 3*Dh): one all-to-all
        full = seq_to_head(fused.contiguous(), ctx.layout, ctx.group)
        fq, fk, fv = full.split(head_dim, dim=-1)
        if ctx.ring is not None:  # Ulysses x ring: the ring between the all-to-alls (executor.ring)
            o = ring_packed_attention(fq.contiguous(), fk.contiguous(), fv.contiguous(), layout=ctx.ring,
                                      group=ctx.ring_group, kind="full_3d")
        else:
            o = packed_attention(fq, fk, fv, samples=ctx.layout.samples, kind="full_3d")
        out = head_to_seq(o.contiguous(), ctx.layout, ctx.group).flatten(1, 2)
        if pad:
            out = torch.cat([out, out.new_zeros(pad, out.shape[1])])
        assert out.shape[0] == tokens
        out = out.type_as(q)
        return attn.to_out[1](attn.to_out[0](out))[None]


class PerSampleWanCrossAttention:
    """Cross-attention of every local token to its own sample's text (no communication)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb: Any = None) -> torch.Tensor:
        ctx = _ctx("cross-attention")
        if encoder_hidden_states is None or attention_mask is not None or attn.add_k_proj is not None:
            raise ValueError("DCP's Wan cross-attention needs the samples' text states, no mask, no image input")
        x = hidden_states[0]
        heads = attn.heads
        q = attn.norm_q(attn.to_q(x)).unflatten(-1, (heads, -1))
        k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(-1, (heads, -1))  # (S, L, H, Dh)
        v = attn.to_v(encoder_hidden_states).unflatten(-1, (heads, -1))
        sample_of = _token_samples(ctx, x.shape[0]).to(x.device)
        out = torch.zeros_like(q)
        for s in range(encoder_hidden_states.shape[0]):
            rows = (sample_of == s).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                               v[s].transpose(0, 1)[None])
            out = out.index_copy(0, rows, o[0].transpose(0, 1))
        out = out.flatten(1, 2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))[None]


def _token_samples(ctx: SPContext, tokens: int) -> torch.Tensor:
    """Sample index of every local token (a padding token counts as sample 0)."""
    sample_of = ctx.layout.local_sample_index()
    pad = tokens - sample_of.shape[0]
    return torch.cat([sample_of, torch.zeros(pad, dtype=torch.long)]) if pad else sample_of


def prepare(model: nn.Module, *, group_sizes: Iterable[int]) -> nn.Module:
    """Install DCP's processors on every block of a ``WanTransformer3DModel`` (in place).

    Raises:
        ValueError: for another model, image conditioning, or a size that does not divide the heads.
    """
    if not hasattr(model, "blocks") or not hasattr(model, "rope") or not hasattr(model, "condition_embedder"):
        raise ValueError("hf_wan supports diffusers' WanTransformer3DModel")
    if model.condition_embedder.image_embedder is not None:  # type: ignore[union-attr]
        raise ValueError("image conditioning (Wan I2V) is not supported")
    clips.check_heads(model, group_sizes=group_sizes, supports="WanTransformer3DModel")
    for block in model.blocks:  # type: ignore[union-attr]
        block.attn1.set_processor(UlyssesWanSelfAttention())
        block.attn2.set_processor(PerSampleWanCrossAttention())
    return model


def patchify(video: torch.Tensor, patch_size: Sequence[int]) -> torch.Tensor:
    """``(C, F, H, W)`` -> ``(f*h*w, p_t*p_h*p_w*C)``, in the order of the model's unpatchify."""
    return clips.patchify(video, patch_size, channels_first=False)


def _embed(model: Any, videos: Sequence[torch.Tensor], ctx: SPContext
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Patch embedding and rotary tables of every sample, this rank's pieces ``(T, D)``, ``(T, 1, Dh)``."""
    def rope(video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = model.rope(video[None])  # (1, n, 1, Dh), the model's own tables
        return cos[0], sin[0]

    def embed(video: torch.Tensor) -> torch.Tensor:
        return model.patch_embedding(video[None]).flatten(2).transpose(1, 2)[0]

    return clips.embed_and_shard(videos, ctx, embed=embed, rope=rope)


def forward(model: Any, work: MicroBatchWork, *, videos: Sequence[torch.Tensor], timesteps: torch.Tensor,
            texts: torch.Tensor) -> torch.Tensor:
    """The model's forward on this rank's tokens of a micro-batch.

    Args:
        model: A ``WanTransformer3DModel`` after :func:`prepare`.
        work: The micro-batch (its ``ctx`` and ``recompute_layers``; ``inputs`` are not used).
        videos: Each sample's latent video ``(C, F, H, W)``.
        timesteps: Each sample's diffusion timestep ``(samples,)``.
        texts: Each sample's text-encoder states ``(samples, L, text_dim)``.

    Returns:
        Per local token prediction ``(T, p_t*p_h*p_w*C_out)`` in the order of :func:`patchify`.
    """
    ctx = work.ctx
    layout = ctx.layout
    num_layers = len(model.blocks)
    validate_policies(work.recompute_layers, num_layers=num_layers, num_samples=layout.num_samples)
    h, cos, sin = _embed(model, videos, ctx)
    temb, timestep_proj, text, _ = model.condition_embedder(timesteps, texts, None)
    timestep_proj = timestep_proj.unflatten(1, (6, -1))  # (S, 6, D)

    def block(index: int) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, sub: SPContext, cos_t: torch.Tensor, sin_t: torch.Tensor, proj: torch.Tensor,
                txt: torch.Tensor) -> torch.Tensor:
            token = _CTX.set(sub)
            try:
                sample_of = _token_samples(sub, x.shape[0]).to(x.device)
                temb_tok = proj.index_select(0, sample_of)[None]  # (1, T, 6, D): per-token modulation
                out = model.blocks[index](x[None], txt, temb_tok, (cos_t[None], sin_t[None]))
            finally:
                _CTX.reset(token)
            return out[0]

        return run

    for index in range(num_layers):
        h = run_split_by_policy(block(index), h, ctx, per_sample=(timestep_proj, text), per_token=(cos, sin),
                                policies=work.recompute_layers, index=index)
    h = h[:layout.local_tokens]
    sample_of = layout.local_sample_index().to(h.device)
    shift, scale = (model.scale_shift_table + temb.index_select(0, sample_of)[:, None]).chunk(2, dim=1)
    h = (model.norm_out(h.float()) * (1 + scale[:, 0]) + shift[:, 0]).type_as(h)
    return model.proj_out(h)


def token_losses(pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of every local token over its patch values ``(T,)``."""
    return ((pred - targets) ** 2).mean(dim=-1)
