"""DCP in torchtitan's decoder models (0.3.x, e.g. its Llama 3): the parts that run without torchtitan.

torchtitan's ``GQAttention`` projects q/k/v, applies RoPE at the ``positions`` it is given and
calls its pluggable ``inner_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks=..., scale=...,
enable_gqa=...)``; its ``Decoder.forward(tokens, positions, attention_masks)`` hands
``attention_masks`` unchanged to every layer. DCP plugs in there, with no change to the model:

- :class:`UlyssesInnerAttention` replaces each ``inner_attention`` (:func:`install`): the
  micro-batch's :class:`DCPMasks` arrives as ``attention_masks``, and the Ulysses all-to-all and
  the causal attention inside each sample are those of the ``transformers`` plug-in
  (:func:`executor.integrations.hf_transformers.ulysses_attention`, grouped-query heads included);
- :func:`model_inputs` turns a :class:`~executor.runtime.MicroBatchWork` into
  ``model(**model_inputs(work))``: this rank's tokens, their positions inside their samples (RoPE
  as unsharded), and the masks object;
- :func:`lm_token_losses` runs the model and returns the per-token loss computed in chunks of
  ``loss_chunk_tokens`` tokens at its output head (``Decoder.output``;
  :func:`executor.chunked_loss.head_chunked_losses`), never the whole logits;
- :func:`install` also gives each decoder layer the plan's checkpoint policy: layer ``i`` is
  recomputed when the micro-batch's largest policy exceeds ``i`` (a micro-batch whose samples
  disagree is checkpointed as its largest policy: the same result, more recompute than planned).

The data loading and the process groups are the executor's own (``PlanBatchSampler`` or
``PlannedSteps``, ``GroupRegistry``); the gradient sum is FSDP2's (``executor.grad_sync.FSDP2Sync``
on the ``fully_shard``-ed model torchtitan builds). torchtitan 0.3.0 itself does not run on a
CPU-only torch (it imports triton through its MoE token dispatcher and falls back to the ``cuda``
device type): ``bench/gpu_trainers.sh`` runs it on a GPU.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from costmodel.specs import LOSS_CHUNK_TOKENS_DEFAULT
from executor.chunked_loss import check_chunk_tokens, head_chunked_losses
from executor.context import SPContext
from executor.integrations.hf_transformers import CTX_KWARG, PAD_KWARG, ulysses_attention
from executor.runtime import MicroBatchWork


@dataclass(kw_only=True, frozen=True, slots=True)
class DCPMasks:
    """What torchtitan passes to every layer as ``attention_masks`` under DCP."""

    ctx: SPContext
    """The micro-batch's layout and process group."""
    pad_tokens: int
    """Trailing padding tokens (1 when this rank holds no token of the micro-batch)."""
    recompute_layers: int
    """Decoder layers recomputed in backward (the micro-batch's largest per-sample policy)."""


class UlyssesInnerAttention(nn.Module):
    """torchtitan's ``inner_attention`` under Ulysses sequence parallelism (no parameters)."""

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: float | None = None, enable_gqa: bool = False,
                is_causal: bool = True, **kwargs: Any) -> torch.Tensor:
        """Attention of this rank's tokens ``(1, L, N, H)`` over their whole samples; same shape out.

        Raises:
            ValueError: without :class:`DCPMasks`, or for non-causal attention.
        """
        if not isinstance(attention_masks, DCPMasks):
            raise ValueError("DCP attention needs attention_masks=DCPMasks; call the model with "
                             "**model_inputs(work)")
        if not is_causal:
            raise ValueError("UlyssesInnerAttention runs causal attention only")
        dcp: dict[str, Any] = {CTX_KWARG: attention_masks.ctx, PAD_KWARG: attention_masks.pad_tokens}
        out, _ = ulysses_attention(self, q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                   None, scaling=scale, **dcp)
        return out


def model_inputs(work: MicroBatchWork) -> dict[str, Any]:
    """``tokens`` ``(1, L)``, ``positions`` ``(1, L)`` (inside each sample) and ``attention_masks``
    for ``Decoder.forward``; a rank holding no token of the micro-batch runs one padding token."""
    ids = work.inputs
    positions = work.ctx.local_positions().to(ids.device)
    pad = 1 if ids.shape[0] == 0 else 0
    if pad:
        ids, positions = ids.new_zeros(1), positions.new_zeros(1)
    masks = DCPMasks(ctx=work.ctx, pad_tokens=pad, recompute_layers=max(work.recompute_layers))
    return {"tokens": ids[None], "positions": positions[None], "attention_masks": masks}


def _check_heads(module: nn.Module, sizes: list[int]) -> None:
    heads = int(getattr(module, "n_heads", 0))
    kv_heads = int(getattr(module, "n_kv_heads", 0) or heads)
    bad = sorted(d for d in sizes if heads == 0 or heads % d or (kv_heads % d and d % kv_heads))
    if bad:
        raise ValueError(f"group sizes {bad} do not fit n_heads={heads}, n_kv_heads={kv_heads} of "
                         f"{type(module).__name__}")


def install(model: nn.Module, *, group_sizes: Iterable[int], layers: Iterable[nn.Module] | None = None) -> int:
    """Swap every attention module's ``inner_attention`` for :class:`UlyssesInnerAttention` and make
    the decoder layers follow the plan's checkpoint policy (names and state dict unchanged).

    Args:
        model: A torchtitan decoder (``model.layers``: its blocks in order), before ``fully_shard``.
        group_sizes: The sizes plans may use (``GroupRegistry.sizes``).
        layers: The decoder layers in order (default: ``model.layers.values()``).

    Returns:
        How many attention modules were swapped.

    Raises:
        ValueError: when no attention module has an ``inner_attention`` or a size does not fit the heads.
    """
    sizes = sorted(set(group_sizes))
    swapped = 0
    for module in model.modules():
        if isinstance(getattr(module, "inner_attention", None), nn.Module):
            _check_heads(module, sizes)
            module.inner_attention = UlyssesInnerAttention()
            swapped += 1
    if swapped == 0:
        raise ValueError(f"{type(model).__name__} has no attention module with an inner_attention")
    blocks = list(layers) if layers is not None else list(model.layers.values())  # type: ignore[operator]
    for index, block in enumerate(blocks):
        if getattr(block, "_dcp_index", None) is None:
            block._dcp_index = index  # type: ignore[assignment]
            block.forward = types.MethodType(_policy_forward(block.forward), block)  # type: ignore[method-assign]
    return swapped


def _policy_forward(original: Any) -> Any:
    def forward(self: Any, x: torch.Tensor, attention_masks: Any, *args: Any, **kwargs: Any) -> Any:
        recompute = isinstance(attention_masks, DCPMasks) and attention_masks.recompute_layers > self._dcp_index
        if recompute and torch.is_grad_enabled():
            return checkpoint(original, x, attention_masks, *args, use_reentrant=False, **kwargs)
        return original(x, attention_masks, *args, **kwargs)

    return forward


def lm_token_losses(model: nn.Module, work: MicroBatchWork, *, loss_chunk_tokens: int = LOSS_CHUNK_TOKENS_DEFAULT,
                    head: nn.Module | None = None) -> torch.Tensor:
    """Cross-entropy of every local token of one micro-batch ``(local,)``, the model run on
    :func:`model_inputs`, ``loss_chunk_tokens`` tokens of logits at a time (0: the whole logits).

    Args:
        model: torchtitan's decoder (or its ``fully_shard``-ed self).
        work: The micro-batch.
        loss_chunk_tokens: Tokens per chunk (the planner's ``ModelSpec.loss_chunk_tokens``).
        head: The output head (default: torchtitan's ``model.output``).

    Raises:
        ValueError: for a negative chunk, or a head that is not a linear layer called once.
    """
    check_chunk_tokens(loss_chunk_tokens)
    targets = work.targets
    if loss_chunk_tokens == 0:
        logits = model(**model_inputs(work))[0, :targets.shape[0]]
        return torch.nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                                                 targets, reduction="none")
    output: Any = head if head is not None else model.output
    return head_chunked_losses(lambda: model(**model_inputs(work)), output, targets, chunk_tokens=loss_chunk_tokens)
