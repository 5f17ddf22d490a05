"""Per-sample activation checkpointing over a stack of layers.

A sample's policy is ``k`` in ``0..L``: it recomputes the first ``k`` layers in backward
(``0`` none, ``L`` full, anything between selective). Samples of one micro-batch may differ:
at layer ``l`` the samples with ``k > l`` run the layer under
``torch.utils.checkpoint`` (non-reentrant), the others run it plainly. Attention never crosses
samples and every sample is sharded on its own (:mod:`executor.layout`), so a layer applied to
a subset of the samples computes exactly what it computes for them inside the full set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from executor import memory
from executor.context import SPContext

Layer = Callable[[torch.Tensor, SPContext], torch.Tensor]


def validate_policies(recompute_layers: Sequence[int], *, num_layers: int, num_samples: int) -> None:
    """Check one policy per sample, each in ``0..num_layers``.

    Raises:
        ValueError: naming the offending sample index and value.
    """
    if len(recompute_layers) != num_samples:
        raise ValueError(f"{len(recompute_layers)} checkpoint policies for {num_samples} samples")
    for i, k in enumerate(recompute_layers):
        if not 0 <= k <= num_layers:
            raise ValueError(f"sample {i}: recompute_layers={k} is outside [0, {num_layers}]")


def _apply(layer: Layer, h: torch.Tensor, ctx: SPContext, recompute: bool) -> torch.Tensor:
    if not recompute or not torch.is_grad_enabled():
        return layer(h, ctx)
    h = memory.keep_checkpoint_input(h)
    out = checkpoint(layer, h, ctx, use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    return out


def run_layers(layers: Sequence[Layer], h: torch.Tensor, ctx: SPContext, *,
               recompute_layers: Sequence[int], extra_rows: int = 0) -> torch.Tensor:
    """Run ``layers`` on the local tokens ``h``, checkpointing per sample.

    Args:
        layers: The layer stack; each maps ``(local_tokens, hidden)`` to the same shape.
        h: Local (sequence-sharded) hidden states, sample after sample; then, with
            ``extra_rows``, that many rows of each sample, sample after sample (the whole text
            tokens of a joint-attention model, :mod:`executor.joint`).
        ctx: The micro-batch context.
        recompute_layers: Policy ``k`` per sample of ``ctx.layout``.
        extra_rows: Rows per sample after the local tokens, kept with their sample.

    Returns:
        The hidden states after the last layer, in the same local order.
    """
    validate_policies(recompute_layers, num_layers=len(layers), num_samples=ctx.layout.num_samples)
    for index, layer in enumerate(layers):
        flags = [k > index for k in recompute_layers]
        if all(flags) or not any(flags):
            h = _apply(layer, h, ctx, flags[0])
            continue
        kept = [i for i, f in enumerate(flags) if f]
        plain = [i for i, f in enumerate(flags) if not f]
        rows_kept = _rows(ctx, kept, extra_rows).to(h.device)
        rows_plain = _rows(ctx, plain, extra_rows).to(h.device)
        out_kept = _apply(layer, h.index_select(0, rows_kept), ctx.subset(kept), True)
        out_plain = _apply(layer, h.index_select(0, rows_plain), ctx.subset(plain), False)
        order = torch.argsort(torch.cat([rows_kept, rows_plain]))
        h = torch.cat([out_kept, out_plain]).index_select(0, order)
    return h


def _rows(ctx: SPContext, samples: Sequence[int], extra_rows: int) -> torch.Tensor:
    """Rows of ``samples`` in a layer input: their local tokens, then their extra rows."""
    rows = ctx.layout.local_rows(samples)
    if not extra_rows:
        return rows
    local = ctx.layout.local_tokens
    extra = [local + s * extra_rows + torch.arange(extra_rows) for s in samples]
    return torch.cat([rows, *extra])


def run_split_by_policy(fn: Callable[..., torch.Tensor], h: torch.Tensor, ctx: SPContext, *,
                        per_sample: Sequence[torch.Tensor], per_token: Sequence[torch.Tensor] = (),
                        policies: Sequence[int], index: int, extra_rows: int = 0) -> torch.Tensor:
    """Layer ``index`` of a model whose forward the integrations run themselves: the samples that
    recompute it (policy ``k > index``) run as one checkpointed sub-batch, the others plain.

    ``fn(x, sub_ctx, *per_token_rows, *per_sample_rows)`` runs the layer on local tokens ``x`` of
    the samples of ``sub_ctx``; ``per_sample`` tensors have one row per sample, ``per_token`` one
    row per local token (rotary tables), both cut to the sub-batch. With ``extra_rows``, ``h``
    holds that many more rows per sample after the local tokens (the whole text tokens of a
    joint-attention model, as in :func:`run_layers`): they go with their sample and ``fn`` gets
    them after the sub-batch's local tokens. A rank holding no row of a sub-batch runs one
    padding token (per-token rows: the first row of each tensor's identity: ones for the first,
    zeros for the others), so that it joins the layer's collectives.
    """
    flags = [k > index for k in policies]
    groups = [[i for i, f in enumerate(flags) if f], [i for i, f in enumerate(flags) if not f]]
    outs, all_rows = [], []
    for recompute, samples in zip((True, False), groups, strict=True):
        if not samples:
            continue
        whole = len(samples) == len(flags)
        sub = ctx if whole else ctx.subset(samples)
        rows = None if whole else _rows(ctx, samples, extra_rows).to(h.device)
        token_rows = rows if rows is None or not extra_rows else ctx.layout.local_rows(samples).to(h.device)
        x = h if rows is None else h.index_select(0, rows)
        tok = [t if token_rows is None else t.index_select(0, token_rows) for t in per_token]
        if x.shape[0] == 0:  # no token of these samples here: one padding token for the collectives
            x = h.new_zeros((1, h.shape[1]))
        tokens = x.shape[0] - len(samples) * extra_rows  # local tokens, with a padding one carried along
        tok = [_pad_rows(t, tokens, one=j == 0) for j, t in enumerate(tok)]
        index_t = torch.tensor(samples, device=h.device)
        args = (x, sub, *tok, *(t.index_select(0, index_t) for t in per_sample))
        out = checkpoint(fn, *args, use_reentrant=False) if recompute and torch.is_grad_enabled() else fn(*args)
        if rows is None:
            return out
        outs.append(out[:rows.numel()])
        all_rows.append(rows)
    order = torch.argsort(torch.cat(all_rows))
    return torch.cat(outs).index_select(0, order)


def _pad_rows(t: torch.Tensor, rows: int, *, one: bool) -> torch.Tensor:
    """``t`` grown to ``rows`` rows with ones (``one``) or zeros."""
    missing = rows - t.shape[0]
    if missing <= 0:
        return t
    fill = t.new_ones if one else t.new_zeros
    return torch.cat([t, fill((missing, *t.shape[1:]))])
