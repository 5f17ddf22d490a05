"""DCP on an unmodified Hugging Face ``transformers`` causal LM.

The model's code is not changed. Three things plug in through the library's own mechanisms:

- Attention: :func:`register` adds ``"dcp_ulysses"`` to ``transformers.AttentionInterface``;
  a model built with ``attn_implementation="dcp_ulysses"`` calls :func:`ulysses_attention` in
  every layer. It swaps this rank's sequence shard of q, k, v (one fused all-to-all, grouped-query
  heads kept with their key/value head) for a head shard of the whole packed micro-batch, runs
  causal attention inside each sample (never across samples) and swaps back. In a group whose
  plan layout is Ulysses x ring (``GroupPlan.ring_degree > 1``: ``u x r``, a pure ring when
  ``u = 1``) the swap runs over the ``u`` ranks of this rank's ring position and the causal
  attention goes round the ring (:func:`executor.ring.ring_packed_attention`, key/value heads
  repeated to the query heads), as the executor's own models do (``executor/models.py``). A layer
  with a ``sliding_window`` or sinks (gpt-oss, Gemma 3's local layers, Mistral with a window) gets
  its own mask (:mod:`executor.integrations.hf_layer_attention`; in a ring group the ring's
  ``window=`` and ``sinks=``: a windowed layer runs only the ring steps its window reaches). MoE
  layers are the model's own code.
- Inputs: :func:`model_inputs` turns a :class:`~executor.runtime.MicroBatchWork` into the
  model's keyword arguments: the local token ids as a batch of one, ``position_ids`` = each
  token's position inside its sample (so RoPE is the unsharded one; in a ring group the tokens
  are the rank's zig-zag chunks and their positions ``SPContext.local_positions``), the SP context and the
  checkpoint policies (``transformers`` passes unknown keyword arguments down to the attention
  function and the decoder layers), and ``use_cache=False`` (a cache lets packed samples see
  each other in eager/sdpa).
- Checkpointing: :func:`prepare` checks the head counts against the group sizes and gives every
  decoder layer (each ``GradientCheckpointingLayer``) the plan's per-sample policy: sample
  ``k`` recomputes the first ``k`` decoder layers; a layer whose samples disagree runs twice, on
  each subset (parameter names and the state dict are unchanged).

Usage (the lines a training loop adds; see ``examples/train_hf_llama.py``)::

    registry = GroupRegistry.from_layouts(world_size=world, rank=rank, layouts=client.epoch_layouts(epoch_id))
    model = LlamaForCausalLM._from_config(config, attn_implementation=hf.register())
    hf.prepare(model, group_sizes=registry.ulysses_degrees)
    for work in executor.micro_batches(rank_plan, loaded=batches):
        work.loss(hf.lm_token_losses(model, work)).backward()

Loss: :func:`lm_token_losses` runs the model with a forward pre-hook on its output head
(``get_output_embeddings()``) that takes the final hidden states, computes the per-token
cross-entropy ``loss_chunk_tokens`` tokens at a time (:mod:`executor.chunked_loss`, the chunk the
planner charged: ``ModelSpec.loss_chunk_tokens``) and hands the head zero tokens, so the whole
logits never exist; the head's weight gets its gradient from the chunked loss. The hook runs
inside the model's own forward, so a DDP or FSDP2 wrapper sees an ordinary call.
``loss_chunk_tokens=0`` (or :func:`token_losses` of the logits) is the whole-logits path.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from costmodel.specs import LOSS_CHUNK_TOKENS_DEFAULT
from executor.attention import packed_attention
from executor.checkpointing import validate_policies
from executor.chunked_loss import check_chunk_tokens, head_chunked_losses
from executor.context import SPContext
from executor.integrations.hf_layer_attention import (
    check_window,
    local_sinks,
    packed_layer_attention,
)
from executor.ring import ring_packed_attention
from executor.runtime import MicroBatchWork
from executor.ulysses import check_kv_heads, head_to_seq, qkv_seq_to_head

ATTENTION_NAME = "dcp_ulysses"
"""The name the attention function is registered under (``attn_implementation``)."""
CTX_KWARG = "dcp_ctx"
"""Keyword argument carrying the micro-batch's :class:`SPContext` down the model."""
POLICY_KWARG = "dcp_recompute_layers"
"""Keyword argument carrying the per-sample checkpoint policies down to the decoder layers."""
PAD_KWARG = "dcp_pad_tokens"
"""Keyword argument: trailing padding tokens (1 when this rank holds no token of the call)."""


def register() -> str:
    """Register the DCP attention with ``transformers`` (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    return ATTENTION_NAME


def check_heads(config: Any, *, group_sizes: Iterable[int]) -> None:
    """Check every group size against the heads Ulysses shards: it divides the query heads, and
    divides the key/value heads or is a multiple of them (past them each rank gets the key/value
    head its query heads use, replicated: ``costmodel.specs.ModelSpec.allowed_group_sizes``).
    For Ulysses x ring groups give their Ulysses degrees, not their sizes
    (``GroupRegistry.ulysses_degrees``): a ring does not split heads.

    Raises:
        ValueError: naming the heads and the sizes they do not allow.
    """
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    bad = sorted(d for d in set(group_sizes) if heads % d or (kv_heads % d and d % kv_heads))
    if bad:
        raise ValueError(f"group sizes {bad} do not fit num_attention_heads={heads}, num_key_value_heads="
                         f"{kv_heads}: a size must divide the query heads and divide the key/value heads or "
                         "be a multiple of them")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order (its ``GradientCheckpointingLayer`` modules)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def prepare(model: nn.Module, *, group_sizes: Iterable[int]) -> nn.Module:
    """Check the model for the group sizes and install per-sample checkpoint policies.

    Args:
        model: A ``transformers`` model built with ``attn_implementation=register()``.
        group_sizes: The degrees plans split the heads over (``GroupRegistry.ulysses_degrees``: the
            pure Ulysses sizes and each Ulysses x ring layout's ``u``).

    Returns:
        The same model (changed in place: each decoder layer's ``forward``).

    Raises:
        ValueError: when the attention is not DCP's, a size does not divide the key/value
            heads, or the model has no decoder layers.
    """
    config: Any = model.config
    attn = getattr(config, "_attn_implementation", None)
    if attn != ATTENTION_NAME:
        raise ValueError(f"the model's attn_implementation is {attn!r}; build it "
                         f"with attn_implementation=register() ({ATTENTION_NAME!r})")
    check_heads(config, group_sizes=group_sizes)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("the model has no GradientCheckpointingLayer decoder layers")
    for index, layer in enumerate(layers):
        layer._dcp_num_layers = len(layers)  # type: ignore[assignment]
        if getattr(layer, "_dcp_index", None) is None:
            layer._dcp_index = index  # type: ignore[assignment]
            layer.forward = types.MethodType(_policy_forward(layer.forward), layer)  # type: ignore[method-assign]
    return model


def _policy_forward(original: Any) -> Any:
    """A decoder layer's forward that follows each sample's checkpoint policy."""

    def forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ctx = kwargs.get(CTX_KWARG)
        policies = kwargs.get(POLICY_KWARG)
        if ctx is None or policies is None:
            raise ValueError(f"call the model with **model_inputs(work) (missing {CTX_KWARG!r} or "
                             f"{POLICY_KWARG!r})")
        if args:
            raise ValueError("decoder layers are expected to get everything but hidden_states by keyword")
        if self._dcp_index == 0:
            validate_policies(policies, num_layers=self._dcp_num_layers, num_samples=ctx.layout.num_samples)
        flags = [k > self._dcp_index for k in policies]
        if all(flags) or not any(flags):
            return _run(original, hidden_states, kwargs, recompute=flags[0])
        # Samples that disagree: run the layer on each subset (the group's ranks run the same
        # subsets, so their all-to-alls match), then put the rows back in local order.
        pad = int(kwargs.get(PAD_KWARG, 0))
        real = hidden_states.shape[1] - pad
        outs, all_rows = [], []
        for recompute in (True, False):
            subset = [i for i, f in enumerate(flags) if f == recompute]
            rows = ctx.layout.local_rows(subset).to(hidden_states.device)
            sub_hidden, sub_kwargs = _subset_call(hidden_states, kwargs, ctx, subset, rows)
            out = _run(original, sub_hidden, sub_kwargs, recompute=recompute)
            outs.append(out[:, :rows.numel()])
            all_rows.append(rows)
        order = torch.argsort(torch.cat(all_rows))
        merged = torch.cat(outs, dim=1).index_select(1, order)
        assert merged.shape[1] == real
        return torch.cat([merged, hidden_states[:, real:]], dim=1) if pad else merged

    return forward


def _subset_call(hidden_states: torch.Tensor, kwargs: dict[str, Any], ctx: SPContext,
                 samples: Sequence[int], rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states and keyword arguments of some samples' local tokens (dim 1).

    A subset with no local token on this rank (samples shorter than the group) still runs, for
    the group's all-to-alls: on one zero padding token that attention leaves out.
    """
    out = dict(kwargs)
    out[CTX_KWARG] = ctx.subset(samples)
    out[POLICY_KWARG] = [kwargs[POLICY_KWARG][s] for s in samples]
    if out.get("attention_mask") is not None:
        raise ValueError("DCP attention takes no attention_mask (samples are bounded by the layout)")
    pad = rows.numel() == 0
    index = torch.zeros(1, dtype=torch.long, device=rows.device) if pad else rows
    out[PAD_KWARG] = 1 if pad else 0
    if out.get("position_ids") is not None:
        out["position_ids"] = out["position_ids"].index_select(1, index)
    if out.get("position_embeddings") is not None:
        out["position_embeddings"] = tuple(t.index_select(1, index) for t in out["position_embeddings"])
    if pad:
        return hidden_states.new_zeros((hidden_states.shape[0], 1, hidden_states.shape[2])), out
    return hidden_states.index_select(1, rows), out


def _run(original: Any, hidden_states: torch.Tensor, kwargs: dict[str, Any], *, recompute: bool) -> Any:
    if not recompute or not torch.is_grad_enabled():
        return original(hidden_states, **kwargs)
    return checkpoint(original, hidden_states, use_reentrant=False, **kwargs)


def _check_unsupported(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse what the model asks of its attention that DCP's does not do, rather than attend
    differently: logit soft-capping (Gemma 2, Gemma 3 with ``attn_logit_softcapping``) and
    non-causal attention (Gemma 3 with ``use_bidirectional_attention``). Sliding windows and sinks
    are run (:mod:`executor.integrations.hf_layer_attention`).

    Raises:
        ValueError: naming the layer and the setting.
    """
    name = type(module).__name__
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{name}: attention softcap={kwargs['softcap']} is not supported under DCP")
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{name}: non-causal attention (is_causal=False, e.g. use_bidirectional_attention) "
                         "is not supported under DCP")


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, scaling: float | None = None,
                      dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention function: Ulysses SP around causal per-sample attention
    (in a Ulysses x ring group: around the ring's, :func:`executor.ring.ring_packed_attention`).

    Args:
        module: The attention module (unused but for its name in errors).
        query: ``(1, H, local_tokens, Dh)``, RoPE applied.
        key: ``(1, H_kv, local_tokens, Dh)``.
        value: ``(1, H_kv, local_tokens, Dh)``.
        attention_mask: Must be ``None`` (samples are bounded by the layout instead).
        scaling: Factor of ``q k^T``.
        dropout: Must be 0.
        **kwargs: Must hold ``dcp_ctx`` (from :func:`model_inputs`).

    Returns:
        ``((1, local_tokens, H, Dh), None)``.
    """
    ctx = kwargs.get(CTX_KWARG)
    if not isinstance(ctx, SPContext):
        raise ValueError(f"{type(module).__name__}: DCP attention needs {CTX_KWARG}=work.ctx; call the "
                         "model with **model_inputs(work)")
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported under DCP (set it to 0)")
    if attention_mask is not None:
        raise ValueError("DCP attention takes no attention_mask (samples are bounded by the layout)")
    _check_unsupported(module, kwargs)
    window = check_window(kwargs.get("sliding_window"), where=type(module).__name__)
    pad = int(kwargs.get(PAD_KWARG, 0))
    batch, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    if batch != 1 or tokens != ctx.layout.local_tokens + pad:
        raise ValueError(f"query shape {tuple(query.shape)}: expected a batch of one with "
                         f"{ctx.layout.local_tokens} local tokens (+{pad} padding)")
    tokens -= pad
    query, key, value = query[:, :, :tokens], key[:, :, :tokens], value[:, :, :tokens]
    check_kv_heads(num_heads=heads, num_kv_heads=kv_heads, group_size=ctx.layout.group_size)
    # (local, H_kv, H/H_kv + 2, Dh): each key/value head with its queries, one all-to-all (past the
    # key/value heads each is replicated to the ranks whose queries use it).
    rep = heads // kv_heads
    fused = torch.cat([query[0].transpose(0, 1).reshape(tokens, kv_heads, rep, head_dim),
                       key[0].transpose(0, 1)[:, :, None], value[0].transpose(0, 1)[:, :, None]], dim=2)
    q, k, v = qkv_seq_to_head(fused, ctx.layout, ctx.group)
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    sinks = local_sinks(kwargs.get("s_aux"), group_size=ctx.layout.group_size,
                        index_in_group=ctx.layout.index_in_group)
    if ctx.ring is not None:  # Ulysses x ring: the ring between the all-to-alls (executor.ring)
        if k.shape[1] != q.shape[1]:  # the ring takes a key/value head per query head
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        o = ring_packed_attention(q, k, v, layout=ctx.ring, group=ctx.ring_group, kind="causal_1d", scale=scale,
                                  window=window, sinks=sinks)
    elif window is not None or sinks is not None:
        o = packed_layer_attention(q, k, v, samples=ctx.layout.samples, window=window, sinks=sinks, scale=scale)
    else:
        o = packed_attention(q, k, v, samples=ctx.layout.samples, kind="causal_1d", scale=scale)
    local = head_to_seq(o, ctx.layout, ctx.group).reshape(tokens, heads, head_dim)
    if pad:
        local = torch.cat([local, local.new_zeros(pad, heads, head_dim)])
    return local[None], None


def model_inputs(work: MicroBatchWork) -> dict[str, Any]:
    """Keyword arguments of the model for one micro-batch (local token ids as a batch of one).

    A rank that holds no token of the micro-batch (every sample shorter than the group) runs
    one padding token, so that it takes part in the group's all-to-alls; its logits are
    dropped by :func:`token_losses`.
    """
    ids = work.inputs
    positions = work.ctx.local_positions().to(ids.device)
    pad = 1 if ids.shape[0] == 0 else 0
    if pad:
        ids, positions = ids.new_zeros(1), positions.new_zeros(1)
    return {
        "input_ids": ids[None],
        "position_ids": positions[None],
        CTX_KWARG: work.ctx,
        POLICY_KWARG: list(work.recompute_layers),
        PAD_KWARG: pad,
        "use_cache": False,
    }


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every local token: logits ``(1, local[+pad], vocab)``, targets ``(local,)``."""
    logits = logits[0, :targets.shape[0]]
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets,
                           reduction="none")


def lm_token_losses(model: nn.Module, work: MicroBatchWork, *,
                    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS_DEFAULT) -> torch.Tensor:
    """Cross-entropy of every local token of one micro-batch ``(local,)``, the model run on
    :func:`model_inputs`, without holding the whole logits (``loss_chunk_tokens`` tokens of
    logits at a time; 0: the whole logits, :func:`token_losses`).

    Raises:
        ValueError: for a negative chunk, a model without a linear output head, or one that
            transforms its logits after the head (``final_logit_softcapping``, which the chunks do
            not apply).
    """
    check_chunk_tokens(loss_chunk_tokens)
    if loss_chunk_tokens == 0:
        return token_losses(model(**model_inputs(work)).logits, work.targets)
    core: Any = getattr(model, "module", model)  # DDP keeps the model under .module
    if getattr(core.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(core).__name__} soft-caps its logits (final_logit_softcapping="
                         f"{core.config.final_logit_softcapping}), which the chunked loss does not: "
                         "use loss_chunk_tokens=0")
    return head_chunked_losses(lambda: model(**model_inputs(work)), core.get_output_embeddings(), work.targets,
                               chunk_tokens=loss_chunk_tokens)
