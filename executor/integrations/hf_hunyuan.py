"""DCP on an unmodified ``diffusers`` HunyuanVideo transformer (MMDiT-style joint text attention).

``HunyuanVideoTransformer3DModel`` (Kong et al. 2024, arXiv:2412.03603) runs dual-stream blocks
(clip and text with their own norms, projections and MLPs, one joint attention over both) and then
single-stream blocks (clip and text rows as one sequence: joint attention and MLP in parallel).
Its ``forward`` patchifies one dense ``(B, C, F, H, W)`` batch of equal-shaped videos and its
blocks modulate by one ``temb`` row per batch element, so it cannot take a rank's shard of a
packed micro-batch of differently shaped clips, each with its own timestep. The model's modules
and parameters are used unchanged; :func:`forward` runs its forward step for step on the rank's
local tokens:

- The clip's tokens are sequence-sharded over the group (patch embedding and the 3D rotary tables
  per sample, cut by ``SPContext.shard``); every sample's text tokens (the model's token refiner
  output, ``J`` per sample, padded ones included as the model keeps them) are whole on every rank
  of the group, as in :mod:`executor.joint`.
- Each block's modulation is per token: each row takes its own sample's ``temb`` row (the
  model's ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` linear layers on ``temb``, then the
  same arithmetic).
- The joint attention: the clip's q/k/v (q/k RMS norm, rotary embedding on the local tokens with
  diffusers' own ``apply_rotary_emb``) go through one all-to-all to this rank's heads of every clip
  token; the text's q/k/v are projected on every rank (``add_*_proj`` in dual blocks, the shared
  ``to_*`` in single blocks, no rotary embedding) and cut to the same heads; per sample and head,
  queries ``[clip; text]`` attend to keys ``[clip; text[:len]]`` (``len`` = the sample's mask
  count: the model masks text keys past it, never clip keys); the clip's output goes back by
  all-to-all, the text's is gathered over the heads (:func:`executor.joint.gather_heads`).
- Per-sample checkpointing: sample ``s`` with policy ``k`` recomputes the first ``k`` blocks
  (dual blocks first, then single ones), its text rows with it
  (:func:`executor.checkpointing.run_split_by_policy` with ``extra_rows``).

Usage (per micro-batch)::

    hf_hunyuan.prepare(model, group_sizes=registry.sizes)
    pred = hf_hunyuan.forward(model, work, videos=videos, timesteps=timesteps, texts=texts,
                              text_masks=masks, pooled=pooled, guidance=guidance)
    work.loss(hf_hunyuan.token_losses(pred, work.targets)).backward()

Gradients: the text stream is computed on every rank of a group, and each rank's copy feeds only
its own heads of the next attention, so the ranks' parameter gradients add up (in the step's sum
over the world) to the plain model's, as in :mod:`executor.joint`. diffusers' ``apply_rotary_emb``
computes in fp32 whatever the model's dtype (both here and in the plain model). Limits: pure
Ulysses groups only (no ring: the planner keeps joint-attention models at ``ring_degree = 1``),
text-to-video (no ``image_condition_type``), no GQA (the model has none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from executor.checkpointing import run_split_by_policy, validate_policies
from executor.context import SPContext
from executor.integrations import clips
from executor.joint import gather_heads
from executor.runtime import MicroBatchWork
from executor.ulysses import head_to_seq, seq_to_head


def prepare(model: nn.Module, *, group_sizes: Iterable[int]) -> nn.Module:
    """Check that :func:`forward` can run ``model`` on groups of ``group_sizes`` (the model is not
    changed: its plain forward still works in one process).

    Raises:
        ValueError: for another model, image conditioning, or a size that does not divide the heads.
    """
    needed = ("transformer_blocks", "single_transformer_blocks", "context_embedder", "time_text_embed", "rope")
    if not all(hasattr(model, name) for name in needed):
        raise ValueError("hf_hunyuan supports diffusers' HunyuanVideoTransformer3DModel")
    config: Any = model.config
    condition = config.image_condition_type
    if condition is not None:
        raise ValueError(f"image conditioning (image_condition_type={condition!r}) is not supported")
    clips.check_heads(model, group_sizes=group_sizes, supports="HunyuanVideoTransformer3DModel")
    return model


def patchify(video: torch.Tensor, patch_size: Sequence[int]) -> torch.Tensor:
    """``(C, F, H, W)`` -> ``(f*h*w, C*p_t*p_h*p_w)``, in the order of the model's unpatchify."""
    return clips.patchify(video, patch_size, channels_first=True)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.unflatten(-1, (heads, t.shape[-1] // heads))


def _joint_attention(attn: Any, clip: torch.Tensor, text: torch.Tensor, ctx: SPContext, cos: torch.Tensor,
                     sin: torch.Tensor, lengths: torch.Tensor, *, dual: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's joint attention on local clip rows ``(T, D)`` and whole text rows ``(S*J, D)``;
    the attention outputs of both (through ``to_out`` / ``to_add_out`` in a dual block)."""
    from diffusers.models.embeddings import apply_rotary_emb

    heads, layout = attn.heads, ctx.layout
    q, k, v = (_heads(proj(clip), heads) for proj in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q, k = attn.norm_q(q), attn.norm_k(k)
    if q.shape[0]:  # (a rank without clip tokens of these samples still joins the collectives)
        tables: Any = (cos, sin)  # diffusers annotates a 1-tuple; the model passes (cos, sin)
        q = apply_rotary_emb(q[None], tables, sequence_dim=1)[0]
        k = apply_rotary_emb(k[None], tables, sequence_dim=1)[0]
    if dual:
        tq, tk, tv = (_heads(proj(text), heads) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
    else:
        tq, tk, tv = (_heads(proj(text), heads) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            tq, tk = attn.norm_q(tq), attn.norm_k(tk)
    head_dim = q.shape[-1]
    d, index = layout.group_size, layout.index_in_group
    mine = slice(index * heads // d, (index + 1) * heads // d)  # the heads seq_to_head gives this rank
    fq, fk, fv = seq_to_head(torch.cat([q, k, v], dim=-1).contiguous(), layout, ctx.group).split(head_dim, dim=-1)
    tq, tk, tv = tq[:, mine], tk[:, mine], tv[:, mine]
    text_tokens = text.shape[0] // layout.num_samples if layout.num_samples else 0
    clip_out, text_out = [], []
    start = 0
    for s, shape in enumerate(layout.samples):
        end, t0 = start + shape.tokens, s * text_tokens
        keep = t0 + int(lengths[s])
        query = torch.cat([fq[start:end], tq[t0:t0 + text_tokens]]).transpose(0, 1)[None]
        key = torch.cat([fk[start:end], tk[t0:keep]]).transpose(0, 1)[None]
        value = torch.cat([fv[start:end], tv[t0:keep]]).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(query, key, value)[0].transpose(0, 1)
        clip_out.append(o[:shape.tokens])
        text_out.append(o[shape.tokens:])
        start = end
    empty = fq.new_zeros((0, fq.shape[1], head_dim))
    clip_o = head_to_seq(torch.cat([empty, *clip_out]).contiguous(), layout, ctx.group).flatten(1, 2).to(q.dtype)
    text_o = torch.cat([empty, *text_out])
    if d > 1:
        assert ctx.group is not None
        text_o = gather_heads(text_o, ctx.group, index)
    text_o = text_o.flatten(1, 2).to(q.dtype)
    if dual:
        return attn.to_out[1](attn.to_out[0](clip_o)), attn.to_add_out(text_o)
    return clip_o, text_o


def _row_samples(ctx: SPContext, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample index of every local clip row and of every text row."""
    num_samples = ctx.layout.num_samples
    return ctx.layout.local_sample_index(), torch.arange(num_samples).repeat_interleave(text_tokens)


def _dual(block: Any, x: torch.Tensor, ctx: SPContext, cos: torch.Tensor, sin: torch.Tensor, temb: torch.Tensor,
          lengths: torch.Tensor, text_tokens: int) -> torch.Tensor:
    """A ``HunyuanVideoTransformerBlock`` on ``[local clip rows; text rows]``, modulated per row."""
    local = ctx.layout.local_tokens
    clip, text = x[:local], x[local:]
    clip_of, text_of = (i.to(x.device) for i in _row_samples(ctx, text_tokens))
    mod = block.norm1.linear(block.norm1.silu(temb)).index_select(0, clip_of).chunk(6, dim=1)
    c_mod = block.norm1_context.linear(block.norm1_context.silu(temb)).index_select(0, text_of).chunk(6, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod
    c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = c_mod
    norm_clip = block.norm1.norm(clip) * (1 + scale_msa) + shift_msa
    norm_text = block.norm1_context.norm(text) * (1 + c_scale_msa) + c_shift_msa
    attn_clip, attn_text = _joint_attention(block.attn, norm_clip, norm_text, ctx, cos, sin, lengths, dual=True)
    clip = clip + attn_clip * gate_msa
    text = text + attn_text * c_gate_msa
    clip = clip + gate_mlp * block.ff(block.norm2(clip) * (1 + scale_mlp) + shift_mlp)
    text = text + c_gate_mlp * block.ff_context(block.norm2_context(text) * (1 + c_scale_mlp) + c_shift_mlp)
    return torch.cat([clip, text])


def _single(block: Any, x: torch.Tensor, ctx: SPContext, cos: torch.Tensor, sin: torch.Tensor, temb: torch.Tensor,
            lengths: torch.Tensor, text_tokens: int) -> torch.Tensor:
    """A ``HunyuanVideoSingleTransformerBlock`` on ``[local clip rows; text rows]``, modulated per row."""
    local = ctx.layout.local_tokens
    rows_of = torch.cat(_row_samples(ctx, text_tokens)).to(x.device)
    shift, scale, gate = block.norm.linear(block.norm.silu(temb)).index_select(0, rows_of).chunk(3, dim=1)
    normed = block.norm.norm(x) * (1 + scale) + shift
    mlp = block.act_mlp(block.proj_mlp(normed))
    attn_clip, attn_text = _joint_attention(block.attn, normed[:local], normed[local:], ctx, cos, sin, lengths,
                                            dual=False)
    return gate * block.proj_out(torch.cat([torch.cat([attn_clip, attn_text]), mlp], dim=1)) + x


def forward(model: Any, work: MicroBatchWork, *, videos: Sequence[torch.Tensor], timesteps: torch.Tensor,
            texts: torch.Tensor, text_masks: torch.Tensor, pooled: torch.Tensor,
            guidance: torch.Tensor | None = None) -> torch.Tensor:
    """The model's forward on this rank's tokens of a micro-batch.

    Args:
        model: A ``HunyuanVideoTransformer3DModel`` checked by :func:`prepare`.
        work: The micro-batch (its ``ctx`` and ``recompute_layers``; ``inputs`` are not used).
        videos: Each sample's latent video ``(C, F, H, W)``.
        timesteps: Each sample's diffusion timestep ``(samples,)``.
        texts: Each sample's text-encoder states ``(samples, J, text_embed_dim)``.
        text_masks: Each sample's text mask ``(samples, J)`` (ones then zeros, as the model reads it).
        pooled: Each sample's pooled text projection ``(samples, pooled_projection_dim)``.
        guidance: Each sample's guidance scale ``(samples,)`` (models with ``guidance_embeds``).

    Returns:
        Per local token prediction ``(T, C_out*p_t*p_h*p_w)`` in the order of :func:`patchify`.

    Raises:
        ValueError: on a ring group, or inputs, policies or patches that do not match the plan.
    """
    ctx = work.ctx
    layout = ctx.layout
    if ctx.ring is not None:
        raise ValueError(f"hf_hunyuan runs pure Ulysses groups only, got a ring of {ctx.ring.ring_degree} "
                         "(joint text attention: the planner keeps such models at ring_degree=1)")
    given = {"videos": len(videos), "timesteps": timesteps.shape[0], "texts": texts.shape[0],
             "text_masks": text_masks.shape[0], "pooled": pooled.shape[0]}
    if guidance is not None:
        given["guidance"] = guidance.shape[0]
    wrong = {name: n for name, n in given.items() if n != layout.num_samples}
    if wrong:
        raise ValueError(f"the micro-batch has {layout.num_samples} samples; got {wrong}")
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    validate_policies(work.recompute_layers, num_layers=len(blocks), num_samples=layout.num_samples)
    clip, cos, sin = clips.embed_and_shard(videos, ctx, embed=lambda v: model.x_embedder(v[None])[0],
                                           rope=lambda v: model.rope(v[None]))
    temb, _ = model.time_text_embed(timesteps, pooled, guidance)
    text = model.context_embedder(texts, timesteps, text_masks)  # (S, J, D), the model's token refiner
    text_tokens = text.shape[1]
    lengths = text_masks.sum(dim=1)
    num_dual = len(model.transformer_blocks)

    def layer(index: int) -> Callable[..., torch.Tensor]:
        run = _dual if index < num_dual else _single

        def fn(x: torch.Tensor, sub: SPContext, cos_t: torch.Tensor, sin_t: torch.Tensor, temb_s: torch.Tensor,
               lengths_s: torch.Tensor) -> torch.Tensor:
            return run(blocks[index], x, sub, cos_t, sin_t, temb_s, lengths_s, text_tokens)

        return fn

    h = torch.cat([clip, text.flatten(0, 1)])
    for index in range(len(blocks)):
        h = run_split_by_policy(layer(index), h, ctx, per_sample=(temb, lengths), per_token=(cos, sin),
                                policies=work.recompute_layers, index=index, extra_rows=text_tokens)
    h = h[:layout.local_tokens]
    sample_of = layout.local_sample_index().to(h.device)
    norm_out = model.norm_out
    scale, shift = norm_out.linear(norm_out.silu(temb).to(h.dtype)).index_select(0, sample_of).chunk(2, dim=1)
    return model.proj_out(norm_out.norm(h) * (1 + scale) + shift)


def token_losses(pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error of every local token over its patch values ``(T,)``."""
    return ((pred - targets) ** 2).mean(dim=-1)
