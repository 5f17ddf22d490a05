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

:func:`record_ring_events` records, in program order, when each hop is posted and waited for and
when each block's compute runs: the overlap is a property of that order, which
``tests/executor/test_ring.py`` checks on real gloo ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from executor.attention import AttentionKind
from executor.ring_layout import RingGroups, RingLayout
from executor.ulysses import head_to_seq, seq_to_head

RING_KINDS: dict[str, bool] = {"causal_1d": True, "full_3d": False}
"""Attention kinds a ring can split (whole-sample attention), and whether each is causal. The 2D
kinds attend inside a frame or along one position's frames, which a ring over the sequence does
not cut."""

RingEvent = tuple[str, int, str]
"""``(pass, step, what)``: pass ``forward`` or ``backward``; what ``post kv`` / ``wait kv`` (a key/
value block's hop), ``post dkv`` / ``wait dkv`` (a gradient sum's hop; at the last step the hop
home), ``attend`` / ``attended`` (a block's attention or its gradients, begin and end), ``dq``
(the backward's query gradient of the block)."""

_events: list[RingEvent] | None = None


@contextlib.contextmanager
def record_ring_events() -> Iterator[list[RingEvent]]:
    """Record the ring's hops and computes in program order (this process, while the block runs).

    Yields:
        The list the events are appended to, as :data:`RingEvent` tuples.
    """
    global _events
    previous, _events = _events, []
    try:
        yield _events
    finally:
        _events = previous


def _note(pass_: str, step: int, what: str) -> None:
    if _events is not None:
        _events.append((pass_, step, what))


class _Pending:
    """The requests of a posted hop; :meth:`wait` before reading the hop's output."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests

    def wait(self) -> None:
        for req in self.requests:
            req.wait()
        self.requests = []


def _post_hop(x: torch.Tensor, group: dist.ProcessGroup | None, *, to: int, frm: int,
              rows_in: int) -> tuple[torch.Tensor, _Pending]:
    """Post: send ``x`` (blocks on dim 1) to group rank ``to``, receive ``rows_in`` rows of the same
    trailing shape from ``frm`` (ring positions hold blocks of different lengths)."""
    assert group is not None, "a hop needs the ring's process group (ring_attention checks it)"
    source = x.contiguous()
    out = source.new_empty((source.shape[0], rows_in, *source.shape[2:]))
    ops = [dist.P2POp(dist.isend, source, dist.get_global_rank(group, to), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, frm), group)]
    return out, _Pending(list(dist.batch_isend_irecv(ops)))


def _block_mask(layout: RingLayout, q_table: tuple[torch.Tensor, torch.Tensor], owner: int,
                causal: bool) -> torch.Tensor:
    """``(Tq, Tk)``: which keys of ring position ``owner``'s block each local query sees."""
    q_sample, q_pos = q_table
    k_sample, k_pos = layout.ring_table(owner)
    mask = q_sample[:, None] == k_sample[None, :]
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    return mask


def _merge(out: torch.Tensor, lse: torch.Tensor, qh: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
           mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend ``qh`` (H, Tq, Dh) to one block under ``mask`` (Tq, Tk) and merge by log-sum-exp."""
    scores = (qh @ kb.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask.to(qh.device)[None], float("-inf"))
    block_lse = torch.logsumexp(scores, dim=-1)  # (H, Tq); -inf where a query sees none
    seen = torch.isfinite(block_lse)
    probs = torch.exp(scores - torch.where(seen, block_lse, 0.0)[..., None])
    block_out = probs @ vb
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
    old_w = torch.where(torch.isfinite(lse), torch.exp(lse - safe), 0.0)[..., None]
    new_w = torch.where(seen, torch.exp(block_lse - safe), 0.0)[..., None]
    return out * old_w + block_out * new_w, new_lse


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation (and gradient-hop) dtype: fp32 for half precision, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _RingAttention(torch.autograd.Function):
    """The whole ring, forward and backward (see the module docstring for the hop schedule)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout,
                group: dist.ProcessGroup | None, causal: bool, scale: float,
                overlap_backward: bool) -> torch.Tensor:
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
                _note("forward", step, "post kv")
            mask = _block_mask(layout, q_table, owner, causal)
            _note("forward", step, "attend")
            if bool(mask.any()):
                out, lse = _merge(out, lse, qh, kv[0].transpose(0, 1), kv[1].transpose(0, 1), mask, scale)
            _note("forward", step, "attended")
            if hop is not None:
                hop[1].wait()
                _note("forward", step, "wait kv")
                kv = hop[0]
        o = out.transpose(0, 1).contiguous()
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.layout, ctx.group, ctx.causal, ctx.scale = layout, group, causal, scale
        ctx.overlap_backward = overlap_backward
        return o

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        group, scale, overlap = ctx.group, ctx.scale, ctx.overlap_backward
        size, rank = layout.ring_degree, layout.ring_index
        to, frm = (rank + 1) % size, (rank - 1) % size
        acc = _acc_dtype(q.dtype)
        q_table = layout.ring_table(rank)
        qh, doh = q.transpose(0, 1).to(acc), grads[0].transpose(0, 1).to(acc)  # (H, Tq, Dh)
        delta = (doh * o.transpose(0, 1).to(acc)).sum(-1, keepdim=True)  # (H, Tq, 1): rowsum(dO * O)
        safe_lse = torch.where(torch.isfinite(lse), lse, 0.0).to(acc)[..., None]
        dq = torch.zeros_like(qh)
        kv = torch.stack([k, v])
        dkv_hop: tuple[torch.Tensor, _Pending] | None = None
        for step in range(size):
            owner = (rank - step) % size
            rows_next = layout.ring_tokens((owner - 1) % size)  # the block that arrives next
            kv_hop = None
            if step < size - 1:  # the next block's keys and values
                kv_hop = _post_hop(kv, group, to=to, frm=frm, rows_in=rows_next)
                _note("backward", step, "post kv")
                if not overlap:
                    kv_hop[1].wait()
                    _note("backward", step, "wait kv")
            mask = _block_mask(layout, q_table, owner, ctx.causal).to(q.device)
            _note("backward", step, "attend")
            block_dkv = torch.zeros((2, *kv.shape[1:]), dtype=acc, device=q.device)
            d_scores = None
            kb = kv[0].transpose(0, 1).to(acc)  # (H, Tk, Dh)
            if bool(mask.any()):
                vb = kv[1].transpose(0, 1).to(acc)
                scores = ((qh @ kb.transpose(1, 2)) * scale).masked_fill(~mask[None], float("-inf"))
                probs = torch.exp(scores - safe_lse)  # P of the final softmax; 0 where masked
                d_scores = probs * (doh @ vb.transpose(1, 2) - delta)  # dS = P * (dP - rowsum(dO * O))
                block_dkv[0] = ((d_scores.transpose(1, 2) @ qh) * scale).transpose(0, 1)
                block_dkv[1] = (probs.transpose(1, 2) @ doh).transpose(0, 1)
            _note("backward", step, "attended")
            if dkv_hop is not None:  # the sum over the ranks that held this block before
                if overlap:
                    dkv_hop[1].wait()
                    _note("backward", step - 1, "wait dkv")
                block_dkv += dkv_hop[0]
            dkv_hop = (block_dkv, _Pending([]))
            if size > 1:  # the sum goes on with the block (after the last step: home to its owner)
                dkv_hop = _post_hop(block_dkv, group, to=to, frm=frm, rows_in=rows_next)
                _note("backward", step, "post dkv")
                if not overlap:
                    dkv_hop[1].wait()
                    _note("backward", step, "wait dkv")
            _note("backward", step, "dq")
            if d_scores is not None:
                dq += (d_scores @ kb) * scale
            if kv_hop is not None:
                if overlap:
                    kv_hop[1].wait()
                    _note("backward", step, "wait kv")
                kv = kv_hop[0]
        assert dkv_hop is not None
        if overlap and size > 1:
            dkv_hop[1].wait()
            _note("backward", size - 1, "wait dkv")
        dkv = dkv_hop[0]
        return (dq.transpose(0, 1).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: RingLayout,
                   group: dist.ProcessGroup | None, causal: bool, scale: float | None = None,
                   overlap_backward: bool = True) -> torch.Tensor:
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

    Returns:
        ``(layout.ring_tokens(j), heads, head_dim)``.

    Raises:
        ValueError: for tensors that do not match the layout, or a ring without a process group.
    """
    size, rank = layout.ring_degree, layout.ring_index
    if q.shape[0] != layout.ring_tokens(rank) or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} for "
                         f"{layout.ring_tokens(rank)} tokens of ring position {rank}")
    if size > 1 and group is None:
        raise ValueError(f"a ring of {size} ranks needs a process group")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out: torch.Tensor = _RingAttention.apply(q, k, v, layout, group, causal, scale, overlap_backward)
    return out


def ring_seq_to_head(x: torch.Tensor, layout: RingLayout, groups: RingGroups) -> torch.Tensor:
    """Local ``(local_tokens, H, Dh)`` -> this ring position's packed sub-samples for ``H/u`` heads."""
    return seq_to_head(x, layout.ulysses_layout(), groups.ulysses)


def ring_head_to_seq(y: torch.Tensor, layout: RingLayout, groups: RingGroups) -> torch.Tensor:
    """Inverse of :func:`ring_seq_to_head`."""
    return head_to_seq(y, layout.ulysses_layout(), groups.ulysses)


def ring_packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: RingLayout,
                          group: dist.ProcessGroup | None, kind: AttentionKind,
                          scale: float | None = None) -> torch.Tensor:
    """The ring's part of a layer's attention, on the head-sharded side (after the Ulysses swap
    over ``layout.ulysses_layout()``, e.g. :func:`ring_seq_to_head`), for the whole-sample kinds of
    :data:`RING_KINDS`; ``group`` is the ring's process group (``SPContext.ring_group``).

    Raises:
        ValueError: for a 2D kind (spatial or temporal attention is not cut by a ring).
    """
    if kind not in RING_KINDS:
        raise ValueError(f"attention kind {kind!r} cannot run on a ring (ring_degree={layout.ring_degree}); "
                         f"ring kinds: {sorted(RING_KINDS)}")
    return ring_attention(q, k, v, layout=layout, group=group, causal=RING_KINDS[kind], scale=scale)
