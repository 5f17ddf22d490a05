"""Ring attention and Ulysses x ring over a group's ranks (issue 25, first stage).

Ulysses needs a group no larger than the heads it splits; ring attention does not split heads:
each of the ``r`` ring positions keeps its queries and the key/value blocks travel around the
ring, one hop per step, ``r - 1`` hops in all (Liu et al., "Ring Attention with Blockwise
Transformers", 2023). A group of ``u x r`` ranks (:mod:`executor.ring_layout`) first swaps
sequence for heads over its ``u`` ranks (:mod:`executor.ulysses`, unchanged), runs the ring over
the ``r`` rank-sets on ``H/u`` heads, and swaps back (the USP hybrid of Fang & Zhao, "USP: A
Unified Sequence Parallelism Approach", 2024, with the degrees chosen per group).

Each ring step attends the local queries to the block in hand under the per-sample mask (a token
sees only its own sample; causal: only positions at or before its own) and merges the partial
result into a running output by log-sum-exp (the online softmax of Milakov & Gimelshein 2018, as
FlashAttention does). A hop is one ``batch_isend_irecv`` (gloo and NCCL), posted before the
current block's attention and waited for after it, so the transfer of the next block overlaps
the compute of this one. Causal samples are balanced by the zig-zag chunks of
:class:`executor.ring_layout.RingLayout`.

Backward: the hop is an autograd function whose backward sends the incoming gradient of the
block one hop the other way (the reverse ring, synchronous: no overlap in backward yet), so the
keys' and values' gradients flow back to the rank that owns them; the merge is plain tensor
arithmetic that autograd differentiates. This keeps every step's block for backward (``r`` key/
value blocks per layer instead of one: ``costmodel.ring`` charges them), where a fused GPU
kernel would recompute; the communication pattern and the result are the ring's.
"""

from __future__ import annotations

import math
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


class _Pending:
    """The requests of a posted hop; :meth:`wait` before reading the hop's output."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def wait(self) -> None:
        for req in self.requests:
            req.wait()
        self.requests = []


def _post_hop(x: torch.Tensor, group: dist.ProcessGroup, *, to: int, frm: int, rows_in: int,
              pending: _Pending) -> torch.Tensor:
    """Post: send ``x`` to group rank ``to``, receive ``rows_in`` rows of the same trailing shape
    from ``frm`` (ring positions hold blocks of different lengths)."""
    source = x.contiguous()
    out = source.new_empty((source.shape[0], rows_in, *source.shape[2:]))
    ops = [dist.P2POp(dist.isend, source, dist.get_global_rank(group, to), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, frm), group)]
    pending.requests = list(dist.batch_isend_irecv(ops))
    return out


class _RingHop(torch.autograd.Function):
    """One hop forward around the ring (posted; the caller waits); its backward is one hop back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int,
                rows_in: int, pending: _Pending) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size, ctx.rows_out = group, rank, size, x.shape[1]
        return _post_hop(x, group, to=(rank + 1) % size, frm=(rank - 1) % size, rows_in=rows_in,
                         pending=pending)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pending = _Pending()
        back = _post_hop(grads[0], ctx.group, to=(ctx.rank - 1) % ctx.size, frm=(ctx.rank + 1) % ctx.size,
                         rows_in=ctx.rows_out, pending=pending)
        pending.wait()
        return back, None, None, None, None, None


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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: RingLayout,
                   group: dist.ProcessGroup | None, causal: bool, scale: float | None = None) -> torch.Tensor:
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
    q_sample, q_pos = layout.ring_table(rank)
    qh = q.transpose(0, 1)  # (H, Tq, Dh)
    out = torch.zeros_like(qh)
    lse = torch.full(qh.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    for step in range(size):
        owner = (rank - step) % size  # whose keys and values are in hand
        nxt, pending = None, _Pending()
        if step < size - 1:  # post the next block's hop before this block's attention
            nxt = _RingHop.apply(kv, group, rank, size, layout.ring_tokens((rank - step - 1) % size), pending)
        k_sample, k_pos = layout.ring_table(owner)
        mask = q_sample[:, None] == k_sample[None, :]
        if causal:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if bool(mask.any()):
            out, lse = _merge(out, lse, qh, kv[0].transpose(0, 1), kv[1].transpose(0, 1), mask, scale)
        if nxt is not None:
            pending.wait()
            # Every hop's output joins the graph (a zero term where its block is masked out), so
            # every rank runs every reverse hop in the same order: none waits on a peer for good.
            out = out + 0.0 * nxt.sum()
            kv = nxt
    return out.transpose(0, 1)


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
