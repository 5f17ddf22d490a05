"""Ring attention and Ulysses x ring over a group's ranks (issue 25).

Ulysses needs a group no larger than the heads it splits; ring attention does not split heads:
each of the ``r`` ring positions keeps its queries and the key/value blocks travel around the
ring, one hop per step, ``r - 1`` hops in all (Liu et al., "Ring Attention with Blockwise
Transformers", 2023). A group of ``u x r`` ranks (:mod:`executor.ring_layout`) first swaps
sequence for heads over its ``u`` ranks (:mod:`executor.ulysses`, unchanged), runs the ring over
the ``r`` rank-sets on ``H/u`` heads, and swaps back (the USP hybrid of Fang & Zhao, "USP: A
Unified Sequence Parallelism Approach", 2024, with the degrees chosen per group).

Forward: each ring step attends the local queries to the block in hand under the per-sample mask
(a token sees only its own sample; causal: only positions at or before its own) and merges the
partial result into a running output by log-sum-exp (the online softmax of Milakov & Gimelshein
2018, as FlashAttention does). A hop is one ``batch_isend_irecv`` (gloo and NCCL), posted before
the current block's attention and waited for after it, so the transfer of the next block
overlaps the compute of this one. Causal samples are balanced by the zig-zag chunks of
:class:`executor.ring_layout.RingLayout`.

Backward (written out, :class:`_RingAttention`; the FlashAttention-2 gradients of Dao 2023,
Alg. 2, per block, from the saved output and log-sum-exp): the key/value blocks go round the ring
again, and with each block the running sum of its key and value gradients over the ranks that
have held it; after the last step that sum takes one more hop home to the block's owner. Every
hop is posted before compute it can overlap and waited for after it: the next block's hop before
this block's gradients, the gradient sum's hop before the query gradient of this block and the
next block's gradients, the hop home before the last query gradient (as
zhuzilin/ring-flash-attention's backward does). The forward keeps only its own keys and values
(the block in hand and the one arriving are the ring's buffers, as ``costmodel.ring.timing``'s
``ring_kv_buffer_bytes`` charges them); on half-precision inputs the gradient sums travel and
accumulate in fp32.

Under a sliding window (``window=``) the ring runs only the steps whose blocks some query's window
reaches, each block sent straight from its owner (:mod:`executor.ring_window`); the shared block
math is :mod:`executor.ring_blocks`.

:func:`record_ring_events` records, in program order, when each hop is posted and waited for and
when each block's compute runs: the overlap is a property of that order, which
``tests/executor/test_ring.py`` checks on real gloo ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from executor.attention import AttentionKind
from executor.ring_blocks import (
    Pending,
    RingEvent,
    acc_dtype,
    apply_sinks,
    backward_start,
    block_grads,
    block_mask,
    merge,
    note,
    post_p2p,
    record_ring_events,
)
from executor.ring_layout import RingGroups, RingLayout
from executor.ring_window import windowed_ring_attention
from executor.ulysses import head_to_seq, seq_to_head

RING_KINDS: dict[str, bool] = {"causal_1d": True, "full_3d": False}
"""Attention kinds a ring can split (whole-sample attention), and whether each is causal. The 2D
kinds attend inside a frame or along one position's frames, which a ring over the sequence does
not cut."""

__all__ = ["RING_KINDS", "RingEvent", "record_ring_events", "ring_attention", "ring_head_to_seq",
           "ring_packed_attention", "ring_seq_to_head"]


def _post_hop(x: torch.Tensor, group: dist.ProcessGroup | None, *, to: int, frm: int,
              rows_in: int) -> tuple[torch.Tensor, Pending]:
    """Post: send ``x`` (blocks on dim 1) to group rank ``to``, receive ``rows_in`` rows of the same
    trailing shape from ``frm`` (ring positions hold blocks of different lengths)."""
    source = x.contiguous()
    out = source.new_empty((source.shape[0], rows_in, *source.shape[2:]))
    return out, post_p2p(group, [(source, to)], [(out, frm)])


class _RingAttention(torch.autograd.Function):
    """The whole ring, forward and backward (see the module docstring for the hop schedule)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout,
                group: dist.ProcessGroup | None, causal: bool, scale: float,
                overlap_backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
        size, rank = layout.ring_degree, layout.ring_index
        q_table = layout.ring_table(rank)
        qh = q.transpose(0, 1)  # (H, Tq, Dh)
        out = torch.zeros_like(qh)
        lse = torch.full(qh.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])  # (2, Tk, H, Dh): one message per hop
        for step in range(size):
            owner = (rank - step) % size  # whose keys and values are in hand
            hop = None
            if step < size - 1:  # post the next block's hop before this block's attention
                hop = _post_hop(kv, group, to=(rank + 1) % size, frm=(rank - 1) % size,
                                rows_in=layout.ring_tokens((owner - 1) % size))
                note("forward", step, "post kv")
            mask = block_mask(layout, q_table, owner, causal)
            note("forward", step, "attend")
            if bool(mask.any()):
                out, lse = merge(out, lse, qh, kv[0].transpose(0, 1), kv[1].transpose(0, 1), mask, scale)
            note("forward", step, "attended")
            if hop is not None:
                hop[1].wait()
                note("forward", step, "wait kv")
                kv = hop[0]
        o = out.transpose(0, 1).contiguous()
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.set_materialize_grads(False)
        ctx.layout, ctx.group, ctx.causal, ctx.scale = layout, group, causal, scale
        ctx.overlap_backward = overlap_backward
        return o, lse

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        group, scale, overlap = ctx.group, ctx.scale, ctx.overlap_backward
        size, rank = layout.ring_degree, layout.ring_index
        to, frm = (rank + 1) % size, (rank - 1) % size
        acc = acc_dtype(q.dtype)
        q_table = layout.ring_table(rank)
        qh, doh, delta, safe_lse, dq = backward_start(q, o, lse, grads)
        kv = torch.stack([k, v])
        dkv_hop: tuple[torch.Tensor, Pending] | None = None
        for step in range(size):
            owner = (rank - step) % size
            rows_next = layout.ring_tokens((owner - 1) % size)  # the block that arrives next
            kv_hop = None
            if step < size - 1:  # the next block's keys and values
                kv_hop = _post_hop(kv, group, to=to, frm=frm, rows_in=rows_next)
                note("backward", step, "post kv")
                if not overlap:
                    kv_hop[1].wait()
                    note("backward", step, "wait kv")
            mask = block_mask(layout, q_table, owner, ctx.causal).to(q.device)
            note("backward", step, "attend")
            block_dkv = torch.zeros((2, *kv.shape[1:]), dtype=acc, device=q.device)
            d_scores = None
            if bool(mask.any()):
                block_dkv, d_scores, kb = block_grads(qh, doh, delta, safe_lse, kv, mask, scale)
            note("backward", step, "attended")
            if dkv_hop is not None:  # the sum over the ranks that held this block before
                if overlap:
                    dkv_hop[1].wait()
                    note("backward", step - 1, "wait dkv")
                block_dkv += dkv_hop[0]
            dkv_hop = (block_dkv, Pending([]))
            if size > 1:  # the sum goes on with the block (after the last step: home to its owner)
                dkv_hop = _post_hop(block_dkv, group, to=to, frm=frm, rows_in=rows_next)
                note("backward", step, "post dkv")
                if not overlap:
                    dkv_hop[1].wait()
                    note("backward", step, "wait dkv")
            note("backward", step, "dq")
            if d_scores is not None:
                dq += (d_scores @ kb) * scale
            if kv_hop is not None:
                if overlap:
                    kv_hop[1].wait()
                    note("backward", step, "wait kv")
                kv = kv_hop[0]
        assert dkv_hop is not None
        if overlap and size > 1:
            dkv_hop[1].wait()
            note("backward", size - 1, "wait dkv")
        dkv = dkv_hop[0]
        return (dq.transpose(0, 1).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: RingLayout,
                   group: dist.ProcessGroup | None, causal: bool, scale: float | None = None,
                   overlap_backward: bool = True, window: int | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this ring position's queries to every key of their samples, keys and values
    passed around the ring.

    Args:
        q: Queries of this rank's ring position ``(layout.ring_tokens(j), heads, head_dim)``: its
            sub-samples packed (after the Ulysses swap: for this rank's ``H/u`` heads).
        k: Keys, same shape (key/value heads repeated to the query heads beforehand).
        v: Values, same shape.
        layout: The micro-batch's layout in the group.
        group: The ring's process group (``r`` ranks; None only for a ring of one).
        causal: A token sees only keys at or before its position in its sample.
        scale: Factor of ``q k^T`` (default ``1 / sqrt(head_dim)``).
        overlap_backward: Post each backward hop before the compute it overlaps (default); False
            waits for every backward hop right after posting it (the synchronous schedule, kept
            for ``bench/ring_overlap.py``'s comparison). The result is the same.
        window: A sliding window (causal only): a query sees the keys of its sample fewer than
            ``window`` positions before it and itself (transformers' ``sliding_window``). The ring
            then runs only the steps whose blocks some local query's window reaches, sending each
            such block straight from its owner (:mod:`executor.ring_window`); None: every step.
        sinks: Attention sinks, one logit per head of ``q`` ``(heads,)`` (gpt-oss; after the Ulysses
            swap this rank's heads' share), joined to every query's softmax
            (:func:`executor.ring_blocks.apply_sinks`); they depend on no key, so change no step.

    Returns:
        ``(layout.ring_tokens(j), heads, head_dim)``.

    Raises:
        ValueError: for tensors that do not match the layout, a ring without a process group, or
            a window that is not a positive integer on causal attention.
    """
    size, rank = layout.ring_degree, layout.ring_index
    if q.shape[0] != layout.ring_tokens(rank) or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} for "
                         f"{layout.ring_tokens(rank)} tokens of ring position {rank}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1 or not causal):
        raise ValueError(f"ring attention: window={window!r} must be a positive integer (tokens) on causal "
                         f"attention (causal={causal})")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"ring attention: sinks {tuple(sinks.shape)} for {q.shape[1]} heads: one logit per head")
    if size > 1 and group is None:
        raise ValueError(f"a ring of {size} ranks needs a process group")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if window is not None:
        out, lse = windowed_ring_attention(q, k, v, layout=layout, group=group, causal=causal, scale=scale,
                                           window=window)
    else:
        out, lse = _RingAttention.apply(q, k, v, layout, group, causal, scale, overlap_backward)
    return apply_sinks(out, lse, sinks)


def ring_seq_to_head(x: torch.Tensor, layout: RingLayout, groups: RingGroups) -> torch.Tensor:
    """Local ``(local_tokens, H, Dh)`` -> this ring position's packed sub-samples for ``H/u`` heads."""
    return seq_to_head(x, layout.ulysses_layout(), groups.ulysses)


def ring_head_to_seq(y: torch.Tensor, layout: RingLayout, groups: RingGroups) -> torch.Tensor:
    """Inverse of :func:`ring_seq_to_head`."""
    return head_to_seq(y, layout.ulysses_layout(), groups.ulysses)


def ring_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: RingLayout,
                          group: dist.ProcessGroup | None, kind: AttentionKind,
                          scale: float | None = None, window: int | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The ring's part of a layer's attention, on the head-sharded side (after the Ulysses swap
    over ``layout.ulysses_layout()``, e.g. :func:`ring_seq_to_head`), for the whole-sample kinds of
    :data:`RING_KINDS`; ``group`` is the ring's process group (``SPContext.ring_group``);
    ``window``: a sliding-window layer's window (``causal_1d`` only) and ``sinks`` its heads' sink
    logits, as :func:`ring_attention` takes them.

    Raises:
        ValueError: for a 2D kind (spatial or temporal attention is not cut by a ring), or a
            window on a non-causal kind.
    """
    if kind not in RING_KINDS:
        raise ValueError(f"attention kind {kind!r} cannot run on a ring (ring_degree={layout.ring_degree}); "
                         f"ring kinds: {sorted(RING_KINDS)}")
    return ring_attention(q, k, v, layout=layout, group=group, causal=RING_KINDS[kind], scale=scale, window=window,
                          sinks=sinks)
