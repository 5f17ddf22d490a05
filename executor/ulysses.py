"""Ulysses sequence parallelism: swap the sequence shard for a head shard and back.

Before attention each rank of a group of ``d`` holds its pieces of every sample for all ``H``
heads; after :func:`seq_to_head` it holds the whole packed sequence for ``H/d`` heads;
:func:`head_to_seq` undoes it. Both are one ``all_to_all_single`` with (possibly uneven)
split sizes, wrapped in an autograd Function whose backward is the opposite all-to-all, so
they work under gloo (CPU) and NCCL (GPU). :func:`qkv_seq_to_head` moves grouped-query q, k
and v in one all-to-all, replicating key/value heads when the group is larger than their number.
Buffers are made contiguous before the collective and outputs are fresh contiguous tensors (gloo
silently corrupts non-contiguous outputs).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from executor.layout import PackedLayout


class EmulatedGroup:
    """Stand-in for the process group of a ``size``-rank group inside one process.

    Profiling one rank's share of a group (``dcp check-model``): the all-to-all becomes a local
    copy into a buffer of the size the real one receives, so compute and memory are the rank's
    and only the communication is left out (it is profiled on its own).
    """

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError(f"an emulated group needs at least 2 ranks, got {size}")
        self.size = size


Group = dist.ProcessGroup | EmulatedGroup
"""A real process group or its single-process stand-in."""


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on a flat tensor; backward swaps the split sizes."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, in_splits: list[int], out_splits: list[int],
                group: Group) -> torch.Tensor:
        ctx.in_splits = in_splits
        ctx.out_splits = out_splits
        ctx.group = group
        return _all_to_all(flat, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = _all_to_all(grads[0], ctx.out_splits, ctx.in_splits, ctx.group)
        return grad, None, None, None


def _all_to_all(flat: torch.Tensor, in_splits: list[int], out_splits: list[int],
                group: Group) -> torch.Tensor:
    source = flat.contiguous()
    out = source.new_empty(sum(out_splits))
    if isinstance(group, EmulatedGroup):  # this rank's data stands in for the peers'
        total, have = out.numel(), source.numel()
        done = 0
        while done < total and have > 0:
            step = min(have, total - done)
            out[done:done + step].copy_(source[:step])
            done += step
        return out
    dist.all_to_all_single(out, source, output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return out


@functools.lru_cache(maxsize=256)
def _indices(layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    return layout.gather_index(), layout.scatter_index()


def seq_to_head(x: torch.Tensor, layout: PackedLayout, group: Group | None) -> torch.Tensor:
    """Sequence-sharded ``(local_tokens, H, Dh)`` -> head-sharded ``(total_tokens, H/d, Dh)``.

    Args:
        x: This rank's tokens for all heads, in local order.
        layout: Token placement of the micro-batch in the group.
        group: The group's process group (``None`` only for a group of one).

    Returns:
        The packed sequence (sample after sample) for this rank's ``H/d`` heads.
    """
    d = layout.group_size
    if d == 1:
        return x
    if group is None:
        raise ValueError(f"a group of size {d} needs a process group")
    tokens, heads, head_dim = x.shape
    if tokens != layout.local_tokens or heads % d != 0:
        raise ValueError(f"seq_to_head: got shape {tuple(x.shape)}, expected "
                         f"({layout.local_tokens}, H divisible by {d}, Dh)")
    hd = heads // d
    # (T_i, d, H/d, Dh) -> (d, T_i, H/d, Dh): chunk j goes to group rank j.
    send = x.reshape(tokens, d, hd, head_dim).transpose(0, 1).reshape(-1)
    unit = hd * head_dim
    in_splits = [tokens * unit] * d
    out_splits = [layout.rank_tokens(r) * unit for r in range(d)]
    recv = _AllToAll.apply(send, in_splits, out_splits, group)
    gather, _ = _indices(layout)
    return recv.view(layout.total_tokens, hd, head_dim).index_select(0, gather.to(recv.device))


def head_to_seq(y: torch.Tensor, layout: PackedLayout, group: Group | None) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``(total_tokens, H/d, Dh)`` -> ``(local_tokens, H, Dh)``."""
    d = layout.group_size
    if d == 1:
        return y
    if group is None:
        raise ValueError(f"a group of size {d} needs a process group")
    total, hd, head_dim = y.shape
    if total != layout.total_tokens:
        raise ValueError(f"head_to_seq: got {total} tokens, expected {layout.total_tokens}")
    _, scatter = _indices(layout)
    send = y.index_select(0, scatter.to(y.device)).reshape(-1)
    unit = hd * head_dim
    local = layout.local_tokens
    in_splits = [layout.rank_tokens(r) * unit for r in range(d)]
    out_splits = [local * unit] * d
    recv = _AllToAll.apply(send, in_splits, out_splits, group)
    return recv.view(d, local, hd, head_dim).transpose(0, 1).reshape(local, d * hd, head_dim)


def check_kv_heads(*, num_heads: int, num_kv_heads: int, group_size: int) -> None:
    """Check that Ulysses can split ``num_heads`` query heads over ``num_kv_heads`` key/value heads
    on a group of ``group_size``: the size divides the query heads, and divides the key/value heads
    or is a multiple of them (then each key/value head is replicated to the ranks whose query heads
    use it, as DeepSpeed-Ulysses and USP do; ``costmodel.specs.ModelSpec.allowed_group_sizes``).

    Raises:
        ValueError: naming the heads and the size.
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    d = group_size
    if d <= 0 or num_heads % d or (num_kv_heads % d and d % num_kv_heads):
        raise ValueError(f"a group of {d} cannot split num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
                         "the size must divide the query heads and divide the key/value heads or be a "
                         "multiple of them")


def qkv_seq_to_head(qkv: torch.Tensor, layout: PackedLayout, group: Group | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped-query q, k, v of this rank's tokens -> head-sharded q, k, v, in one all-to-all.

    ``qkv`` holds, per key/value head, the ``r = H / H_kv`` query heads that use it, then its key,
    then its value. While the group size ``d`` divides ``H_kv`` each rank gets ``H_kv / d`` key/value
    heads with their queries. Past them (``d > H_kv``, a multiple) each key/value head is replicated
    to the ``d / H_kv`` ranks whose query heads use it, so each rank gets one key/value head and
    ``H / d`` of its queries; autograd sums the replicas' gradients back into the head.

    Args:
        qkv: ``(local_tokens, H_kv, r + 2, Dh)``.
        layout: Token placement of the micro-batch in the group.
        group: The group's process group (``None`` only for a group of one).

    Returns:
        ``q`` ``(total_tokens, H/d, Dh)``; ``k`` and ``v`` ``(total_tokens, u, Dh)`` with ``u`` this
        rank's key/value heads (``H_kv / d``, or 1 past them): query head ``j`` of this rank uses
        key/value head ``j // (H / d / u)``, the grouped-query form
        :func:`executor.attention.packed_attention` takes (no copy per query head). The query heads
        are those :func:`head_to_seq` puts back in order: rank ``i`` holds ``i H/d .. (i+1) H/d - 1``.

    Raises:
        ValueError: when the heads do not split over the group (:func:`check_kv_heads`).
    """
    units = qkv_units(qkv, group_size=layout.group_size)
    tokens, num_units, width, head_dim = units.shape
    full = seq_to_head(units.reshape(tokens, num_units, width * head_dim), layout, group)
    return split_units(full.view(full.shape[0], num_units // layout.group_size, width, head_dim))


def qkv_units(qkv: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """``(tokens, H_kv, r + 2, Dh)`` -> the exchange units ``(tokens, U, H/U + 2, Dh)``: a key/value
    head (or, past ``H_kv``, a replica of it) with the query heads that use it; ``U = max(H_kv, d)``
    and group rank ``i`` of :func:`qkv_seq_to_head` gets units ``i U/d .. (i+1) U/d - 1``.

    Raises:
        ValueError: when the heads do not split over the group (:func:`check_kv_heads`).
    """
    tokens, kv_heads, width, head_dim = qkv.shape
    rep = width - 2
    check_kv_heads(num_heads=kv_heads * rep, num_kv_heads=kv_heads, group_size=group_size)
    units = max(kv_heads, group_size)
    if units == kv_heads:
        return qkv
    copies, per_unit = units // kv_heads, kv_heads * rep // units
    q = qkv[:, :, :rep].reshape(tokens, kv_heads, copies, per_unit, head_dim)
    kv = qkv[:, :, None, rep:].expand(tokens, kv_heads, copies, 2, head_dim)
    return torch.cat([q, kv], dim=3).reshape(tokens, units, per_unit + 2, head_dim)


def split_units(units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exchange units ``(tokens, u, p + 2, Dh)`` -> ``q`` ``(tokens, u p, Dh)``, ``k`` and ``v``
    ``(tokens, u, Dh)`` (query head ``j`` uses key/value head ``j // p``)."""
    tokens, num_units, width, head_dim = units.shape
    per_unit = width - 2
    q = units[:, :, :per_unit].reshape(tokens, num_units * per_unit, head_dim)
    return q, units[:, :, per_unit], units[:, :, per_unit + 1]
