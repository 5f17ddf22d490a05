"""DCP on an unmodified ``diffusers`` Latte video transformer (spatial + temporal attention).

``LatteTransformer3DModel.forward`` takes one dense ``(B, C, F, H, W)`` video and reshapes it
between its spatial blocks (``(B*F, h*w, D)``) and temporal blocks (``(B*h*w, F, D)``), so it
cannot take a rank's shard of a packed micro-batch of differently shaped videos. The model's
code and modules are used unchanged; what plugs in:

- Attention processors (``Attention.set_processor``, diffusers' own mechanism): the
  self-attention of every spatial block runs :class:`UlyssesSelfAttention` (``spatial_2d``:
  within each frame) and of every temporal block ``temporal_2d`` (across frames at each
  position), one fused q/k/v all-to-all each way; cross-attention to the caption runs
  :class:`PerSampleCrossAttention` (local queries against their own sample's caption, no
  communication).
- :func:`forward`: the model's forward, step for step (patch embedding with its positional
  embedding, AdaLN-single timestep embedding, caption projection, spatial then temporal block
  per layer, the temporal positional embedding before the first temporal block, output
  modulation and projection), on the rank's local tokens as a batch of tokens (``(T, 1, D)``),
  so that the blocks' AdaLN modulation is per token, i.e. per sample; each sample's checkpoint
  policy recomputes its first ``k`` (spatial, temporal) layer pairs.

Usage (per micro-batch; ``videos``, ``timesteps``, ``captions`` of the micro-batch's samples)::

    hf_diffusers.prepare(model, group_sizes=registry.sizes)
    pred = hf_diffusers.forward(model, work, videos=videos, timesteps=timesteps, captions=captions)
    work.loss(hf_diffusers.token_losses(pred, work.targets)).backward()

Limits: ``norm_type="ada_norm_single"`` (Latte's), no attention masks, a sample's frame
count must be 1 or the model's ``video_length`` (the model's own rule), and Ulysses groups only:
spatial and temporal attention are not cut by a ring over the sequence (``executor.ring.RING_KINDS``;
the planner gives 2D models no ring layouts), so :func:`forward` refuses a ring group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from executor.attention import AttentionKind, packed_attention
from executor.checkpointing import run_split_by_policy, validate_policies
from executor.context import SPContext
from executor.integrations import clips
from executor.runtime import MicroBatchWork
from executor.ulysses import head_to_seq, seq_to_head

CTX_KWARG = "dcp_ctx"
"""Keyword argument (``cross_attention_kwargs``) carrying the SP context to the processors."""


def _check_plain(attn: Any) -> None:
    if getattr(attn, "norm_q", None) is not None or getattr(attn, "norm_k", None) is not None:
        raise ValueError("attention with q/k normalisation is not supported")
    if attn.residual_connection or attn.rescale_output_factor != 1.0 or attn.group_norm is not None:
        raise ValueError("attention with residual connection, rescaling or group norm is not supported")


def _tokens_of(hidden_states: torch.Tensor, ctx: SPContext) -> tuple[torch.Tensor, int]:
    """``(T + pad, 1, D)`` -> ``(T, D)`` and the padding count (a rank with no token runs one)."""
    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)}: call the blocks through forward()")
    pad = hidden_states.shape[0] - ctx.layout.local_tokens
    if pad not in (0, 1):
        raise ValueError(f"{hidden_states.shape[0]} tokens for a layout of {ctx.layout.local_tokens}")
    return hidden_states[:hidden_states.shape[0] - pad, 0], pad


class UlyssesSelfAttention:
    """Self-attention of one block under Ulysses SP, sample-bounded (spatial or temporal)."""

    def __init__(self, kind: AttentionKind) -> None:
        self.kind: AttentionKind = kind

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, dcp_ctx: SPContext | None = None) -> torch.Tensor:
        """``(T[+pad], 1, D)`` local tokens -> same shape."""
        if dcp_ctx is None:
            raise ValueError("DCP attention needs dcp_ctx: run the model through hf_diffusers.forward()")
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("DCP self-attention takes no mask and no encoder states")
        x, pad = _tokens_of(hidden_states, dcp_ctx)
        tokens, heads = x.shape[0], attn.heads
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        head_dim = q.shape[-1] // heads
        fused = torch.stack([t.view(tokens, heads, head_dim) for t in (q, k, v)], dim=2)
        full = seq_to_head(fused.reshape(tokens, heads, 3 * head_dim), dcp_ctx.layout, dcp_ctx.group)
        fq, fk, fv = full.view(full.shape[0], full.shape[1], 3, head_dim).unbind(dim=2)
        o = packed_attention(fq, fk, fv, samples=dcp_ctx.layout.samples, kind=self.kind, scale=attn.scale)
        local = head_to_seq(o, dcp_ctx.layout, dcp_ctx.group).reshape(tokens, heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](local))
        if pad:
            out = torch.cat([out, out.new_zeros(pad, out.shape[1])])
        return out[:, None]


class PerSampleCrossAttention:
    """Cross-attention of local tokens to their own sample's caption (no communication)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, dcp_ctx: SPContext | None = None) -> torch.Tensor:
        """``(T[+pad], 1, D)`` local tokens, captions ``(samples, L, D)`` -> ``(T[+pad], 1, D)``."""
        if dcp_ctx is None or encoder_hidden_states is None:
            raise ValueError("DCP cross-attention needs dcp_ctx and one caption per sample")
        if attention_mask is not None:
            raise ValueError("DCP cross-attention takes no mask")
        layout = dcp_ctx.layout
        if encoder_hidden_states.shape[0] != layout.num_samples:
            raise ValueError(f"{encoder_hidden_states.shape[0]} captions for {layout.num_samples} samples")
        x = hidden_states[:, 0]
        heads = attn.heads
        q = attn.to_q(x)
        k, v = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = q.shape[-1] // heads
        counts = [layout.pieces[s][layout.index_in_group] for s in range(layout.num_samples)]
        counts[0] += x.shape[0] - sum(counts)  # a padding token goes with the first sample
        outs, start = [], 0
        for s, n in enumerate(counts):
            qs = q[start:start + n].view(n, heads, head_dim).transpose(0, 1)
            ks = k[s].view(-1, heads, head_dim).transpose(0, 1)
            vs = v[s].view(-1, heads, head_dim).transpose(0, 1)
            outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=attn.scale)
                        .transpose(0, 1).reshape(n, heads * head_dim))
            start += n
        return attn.to_out[1](attn.to_out[0](torch.cat(outs)))[:, None]


def prepare(model: nn.Module, *, group_sizes: Iterable[int]) -> nn.Module:
    """Check the model and install the DCP attention processors (in place).

    Raises:
        ValueError: for a model that is not Latte-like (``ada_norm_single`` blocks, spatial and
            temporal block lists) or heads that a group size does not divide.
    """
    for name in ("transformer_blocks", "temporal_transformer_blocks", "adaln_single", "pos_embed"):
        if not hasattr(model, name):
            raise ValueError(f"the model has no {name!r}: hf_diffusers supports LatteTransformer3DModel")
    clips.check_heads(model, group_sizes=group_sizes, supports="LatteTransformer3DModel")
    for kind, blocks in (("spatial_2d", model.transformer_blocks), ("temporal_2d", model.temporal_transformer_blocks)):
        for block in blocks:  # type: ignore[union-attr]
            if block.norm_type != "ada_norm_single":
                raise ValueError(f"norm_type={block.norm_type!r}: only 'ada_norm_single' (Latte) is supported")
            _check_plain(block.attn1)
            block.attn1.set_processor(UlyssesSelfAttention(kind))  # type: ignore[arg-type]
            if block.attn2 is not None:
                _check_plain(block.attn2)
                block.attn2.set_processor(PerSampleCrossAttention())  # type: ignore[arg-type]
    return model


def _embed(model: Any, videos: Sequence[torch.Tensor], ctx: SPContext) -> torch.Tensor:
    """Patch + positional embedding of every sample, this rank's pieces (``(T, D)``)."""
    parts = []
    for s, video in enumerate(videos):
        frames = video.shape[1]
        if frames != ctx.layout.samples[s].frames:
            raise ValueError(f"sample {s}: video has {frames} frames, the plan {ctx.layout.samples[s].frames}")
        tokens = model.pos_embed(video.permute(1, 0, 2, 3))  # (F, h*w, D), like the model's forward
        tokens = tokens.reshape(-1, tokens.shape[-1])
        if tokens.shape[0] != ctx.layout.samples[s].tokens:
            raise ValueError(f"sample {s}: {tokens.shape[0]} patches, the plan has {ctx.layout.samples[s].tokens}")
        parts.append(ctx.layout.shard(tokens, s))
    return torch.cat(parts)


def forward(model: Any, work: MicroBatchWork, *, videos: Sequence[torch.Tensor], timesteps: torch.Tensor,
            captions: torch.Tensor) -> torch.Tensor:
    """The model's forward on this rank's tokens of a micro-batch.

    Args:
        model: A ``LatteTransformer3DModel`` after :func:`prepare`.
        work: The micro-batch (its ``ctx`` and ``recompute_layers``; ``inputs`` are not used).
        videos: Each sample's latent video ``(C, F, H, W)``.
        timesteps: Each sample's diffusion timestep ``(samples,)``.
        captions: Each sample's caption embeddings ``(samples, L, caption_channels)``.

    Returns:
        Per local token prediction ``(T, p*p*C_out)`` in the order of ``patchify``.
    """
    ctx = work.ctx
    if ctx.ring is not None:
        raise ValueError(f"micro-batch {work.index}: a Ulysses x ring group (ring_degree={ctx.ring.ring_degree}) "
                         "cannot run Latte's spatial and temporal attention; plan it with layout='ulysses' "
                         "(the planner gives 2D models no ring layouts)")
    layout = ctx.layout
    num_layers = len(model.transformer_blocks)
    validate_policies(work.recompute_layers, num_layers=num_layers, num_samples=layout.num_samples)
    h = _embed(model, videos, ctx)
    t_emb, embedded_t = model.adaln_single(timesteps, added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                           batch_size=layout.num_samples, hidden_dtype=h.dtype)
    text = model.caption_projection(captions)
    cond = (t_emb, text, embedded_t)
    temp_pos = model.temp_pos_embed[0].to(h.dtype)

    def layer(index: int) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, sub: SPContext, t_emb: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
            tokens, pad = x.shape[0], x.shape[0] - sub.layout.local_tokens
            sample_of = torch.cat([sub.layout.local_sample_index(), torch.zeros(pad, dtype=torch.long)])
            positions = torch.cat([sub.layout.local_positions(), torch.zeros(pad, dtype=torch.long)])
            t_tok = t_emb.index_select(0, sample_of.to(x.device))
            kwargs = {CTX_KWARG: sub}
            x = model.transformer_blocks[index](x[:, None], None, text, None, t_tok, kwargs, None)[:, 0]
            if index == 0:
                frames = torch.tensor([s.frames for s in sub.layout.samples])[sample_of]
                spatial = torch.tensor([s.spatial for s in sub.layout.samples])[sample_of]
                frame = positions // spatial
                add = temp_pos.index_select(0, frame.clamp(max=temp_pos.shape[0] - 1).to(x.device))
                x = x + torch.where((frames > 1).to(x.device)[:, None], add, torch.zeros_like(add))
            x = model.temporal_transformer_blocks[index](x[:, None], None, None, None, t_tok, kwargs, None)[:, 0]
            assert x.shape[0] == tokens
            return x

        return run

    for index in range(num_layers):
        h = run_split_by_policy(layer(index), h, ctx, per_sample=cond[:2], policies=work.recompute_layers,
                                index=index)
    h = h[:layout.local_tokens]  # drop a padding token
    sample_of = layout.local_sample_index().to(h.device)
    shift, scale = (model.scale_shift_table[None] + embedded_t.index_select(0, sample_of)[:, None]).chunk(2, dim=1)
    h = model.norm_out(h[:, None]) * (1 + scale) + shift
    return model.proj_out(h)[:, 0]


def patchify(video: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``(C, F, H, W)`` -> ``(F*h*w, p*p*C)``, frame-major, in the order of the model's unpatchify."""
    channels, frames, height, width = video.shape
    h, w = height // patch_size, width // patch_size
    x = video.permute(1, 2, 3, 0).reshape(frames, h, patch_size, w, patch_size, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(frames * h * w, patch_size * patch_size * channels)


def token_losses(pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of every local token over its ``p*p*C`` values ``(T,)``."""
    return ((pred - targets) ** 2).mean(dim=-1)
