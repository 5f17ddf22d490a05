"""The language-model loss in chunks of tokens: never the whole logits at once.

A causal LM's loss projects every token's final hidden state on the vocabulary (``V`` values a
token: 128,256 for Llama 3) and takes the cross-entropy. Materialised whole, those logits are
the largest buffer of a long sample (131,072 tokens x 128,256 x 4 B = 67 GB in fp32).
:func:`chunked_token_losses` runs the projection and the cross-entropy ``chunk_tokens`` tokens at
a time and keeps only each token's log-sum-exp (4 bytes) for backward; backward projects each
chunk again (one more head GEMM forward), forms the chunk's softmax gradient and adds its
contributions to the hidden states' and the head's gradients. The result equals the plain
``F.cross_entropy(h @ W.T + b, targets, reduction="none")`` up to rounding, gradients included.

Memory at the peak is one chunk's logits in the compute dtype plus their fp32 copy (the
softmax runs in fp32 whatever the compute dtype, as the plain path upcasts):
:func:`chunk_peak_bytes` is that count, the one the cost model charges
(``costmodel.model_terms.loss_chunk_bytes``). Sequence parallelism needs nothing more: each
rank runs the loss over its own shard of the tokens, so a chunk is counted in a rank's local
tokens.

The same memory saving as Liger-Kernel's fused linear cross-entropy, torchtune's chunked
cross-entropy and Megatron's vocab-parallel loss (Hsu et al. 2024, "Liger Kernel"), here as a
plain PyTorch autograd function (runs on any device; no extra dependency).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100
"""Targets equal to this contribute no loss and no gradient (``F.cross_entropy``'s default)."""

LOSS_CHUNK_OPTION = "loss_chunk_tokens"
"""The option's name, as messages show it."""


def check_chunk_tokens(chunk_tokens: int, *, tokens: int | None = None) -> int:
    """Validate a ``loss_chunk_tokens`` value: 0 (whole logits) or a positive chunk, at most
    ``tokens`` when a sample length is given.

    Raises:
        ValueError: naming the option and the value.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise ValueError(f"{LOSS_CHUNK_OPTION} must be an integer, got {chunk_tokens!r}")
    if chunk_tokens < 0:
        raise ValueError(f"{LOSS_CHUNK_OPTION}={chunk_tokens} must be positive (or 0 for whole logits)")
    if tokens is not None and chunk_tokens > tokens:
        raise ValueError(f"{LOSS_CHUNK_OPTION}={chunk_tokens} is larger than the sample ({tokens} tokens): "
                         "give a chunk of at most the sample's tokens, or 0 for whole logits")
    return chunk_tokens


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cross-entropy runs in: fp32, or the compute dtype when it is wider."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A chunk's logits, upcast to the softmax dtype (the compute-dtype logits are freed then)."""
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    return logits.to(_softmax_dtype(logits.dtype))


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``h @ W.T + b`` chunk by chunk; backward projects again."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        tokens = hidden.shape[0]
        out_dtype = _softmax_dtype(hidden.dtype)
        losses = torch.empty(tokens, dtype=out_dtype, device=hidden.device)
        lse = torch.empty(tokens, dtype=out_dtype, device=hidden.device)
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            z = _chunk_logits(hidden[start:end], weight, bias)
            target_logit = z.gather(1, safe[start:end, None])[:, 0]
            top = z.amax(dim=1)
            z.sub_(top[:, None]).exp_()  # in place: the chunk's one V-wide fp32 buffer
            chunk_lse = z.sum(dim=1).log_().add_(top)
            del z
            lse[start:end] = chunk_lse
            losses[start:end] = torch.where(valid[start:end], chunk_lse - target_logit, 0.0)
        ctx.chunk_tokens = chunk_tokens
        device = hidden.device.type  # backward projects again under forward's autocast, if any
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        return losses

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_losses = grads[0]
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        chunk_tokens: int = ctx.chunk_tokens
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        device, autocast_on, autocast_dtype = ctx.autocast
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        scale = torch.where(valid, grad_losses, 0.0).to(lse.dtype)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            h = hidden[start:end]
            with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on):
                p = _chunk_logits(h, weight, bias)
            p.sub_(lse[start:end, None]).exp_()  # softmax, in place
            rows = torch.arange(end - start, device=p.device)
            p[rows, safe[start:end]] -= 1.0
            p.mul_(scale[start:end, None])
            dz = p.to(hidden.dtype)  # the compute dtype for the GEMMs (no copy when equal)
            del p
            if grad_h is not None:
                torch.mm(dz, weight.to(dz.dtype), out=grad_h[start:end])
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h)
            if grad_b is not None:
                grad_b += dz.sum(dim=0)
            del dz
        return grad_h, grad_w, grad_b, None, None


def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of every token of ``hidden @ weight.T + bias`` against ``targets``, computed
    ``chunk_tokens`` tokens at a time (0: the whole logits at once, the plain path).

    Args:
        hidden: Final hidden states ``(tokens, hidden)`` (after the final norm).
        weight: The output head's weight ``(vocab, hidden)``.
        targets: Target token ids ``(tokens,)``; :data:`IGNORE_INDEX` for tokens without a loss.
        chunk_tokens: Tokens per chunk (``loss_chunk_tokens``), or 0 for whole logits.
        bias: The output head's bias ``(vocab,)``, if it has one.

    Returns:
        Per-token losses ``(tokens,)`` in fp32 (fp64 for fp64 inputs), 0 at ignored targets.

    Raises:
        ValueError: for a negative chunk or mismatched shapes, naming them.
    """
    check_chunk_tokens(chunk_tokens)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} do not "
                         "make (tokens, hidden) @ (vocab, hidden).T")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have one id per token of hidden "
                         f"{tuple(hidden.shape)}")
    if chunk_tokens == 0:
        logits = torch.nn.functional.linear(hidden, weight, bias)
        return torch.nn.functional.cross_entropy(logits.to(_softmax_dtype(logits.dtype)), targets,
                                                 reduction="none", ignore_index=IGNORE_INDEX)
    out = _ChunkedCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens)
    assert isinstance(out, torch.Tensor)
    return out


def chunk_peak_bytes(*, chunk_tokens: int, vocab: int, dtype_bytes: int) -> int:
    """Bytes the chunked loss holds at its peak beyond its inputs and gradients: one chunk's
    logits in the compute dtype and their fp32 copy (``dtype_bytes`` 4 or more: the one copy),
    as :func:`chunked_token_losses` allocates them in forward and again in backward."""
    softmax_bytes = max(dtype_bytes, 4)
    logit_bytes = dtype_bytes if dtype_bytes < 4 else 0
    return chunk_tokens * vocab * (logit_bytes + softmax_bytes)


def head_chunked_losses(run_model: Callable[[], object], head: nn.Module, targets: torch.Tensor, *,
                        chunk_tokens: int) -> torch.Tensor:
    """The per-token loss of a model whose output head is ``head``, without the whole logits.

    ``run_model()`` runs the model's forward once. A forward pre-hook on ``head`` takes the final
    hidden states ``(1, tokens[+pad], hidden)`` it is called with, computes
    :func:`chunked_token_losses` of the first ``len(targets)`` tokens with the head's weight and
    bias, and hands the head zero tokens, so the whole logits never exist. The hook runs inside
    the model's own forward: a DDP or FSDP2 wrapper sees an ordinary call, and FSDP2's unsharded
    head weight is the one the loss uses and saves.

    Raises:
        ValueError: when ``head`` is not a linear layer, or the forward calls it other than once.
    """
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the output head is a {type(head).__name__}, not a linear layer: use "
                         f"{LOSS_CHUNK_OPTION}=0")
    found: list[torch.Tensor] = []

    def take_hidden(module: nn.Linear, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden = args[0]
        found.append(chunked_token_losses(hidden[0, :targets.shape[0]], module.weight, targets,
                                          chunk_tokens=chunk_tokens, bias=module.bias))
        return (hidden[:, :0], *args[1:])

    handle = head.register_forward_pre_hook(take_hidden)
    try:
        run_model()
    finally:
        handle.remove()
    if len(found) != 1:
        raise ValueError(f"the output head ran {len(found)} times in one forward (expected once): use "
                         f"{LOSS_CHUNK_OPTION}=0")
    return found[0]
