"""Ring attention over a group's ranks, on the executor's packed layout (issue 25, first stage).

Ulysses needs a group no larger than the heads it splits; ring attention does not split heads:
each of the ``r`` ranks keeps its queries (its piece of every sample, ``PackedLayout``) and the
key/value blocks travel around the ring, one hop per step, ``r - 1`` hops in all (Liu et al.,
"Ring Attention with Blockwise Transformers", 2023). Each step attends the local queries to the
block in hand under the per-sample mask (a token sees only its own sample; causal: only earlier
positions) and merges the partial result into a running output by log-sum-exp (the online
softmax of Milakov & Gimelshein 2018, as FlashAttention does). A hop is one ``batch_isend_irecv``
(gloo and NCCL); here each hop completes before the block's attention, so communication does not
yet overlap compute (the GPU version's job: post the next hop, attend, then wait).

Backward: the hop is an autograd function whose backward sends the incoming gradient one hop
the other way (the reverse ring), so the keys' and values' gradients flow back to the rank that
owns them; the merge is plain tensor arithmetic that autograd differentiates. This keeps every
step's block for backward (more memory than a fused kernel that recomputes), which a GPU version
would replace; the communication pattern and the result are the ring's.

Not here yet: zig-zag load balancing of causal samples (with contiguous pieces the last rank
does most of a causal sample's work), the hybrid Ulysses x ring layout, and a cost function.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from executor.layout import PackedLayout


def _hop(x: torch.Tensor, group: dist.ProcessGroup, *, to: int, frm: int, rows_in: int) -> torch.Tensor:
    """Send ``x`` to group rank ``to`` and receive ``rows_in`` rows of the same trailing shape from
    ``frm`` (ranks hold pieces of different lengths)."""
    source = x.contiguous()
    out = source.new_empty((source.shape[0], rows_in, *source.shape[2:]))
    ops = [dist.P2POp(dist.isend, source, dist.get_global_rank(group, to), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, frm), group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingHop(torch.autograd.Function):
    """One hop forward around the ring; its backward is one hop the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int,
                rows_in: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size, ctx.rows_out = group, rank, size, x.shape[1]
        return _hop(x, group, to=(rank + 1) % size, frm=(rank - 1) % size, rows_in=rows_in)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _hop(grads[0], ctx.group, to=(ctx.rank - 1) % ctx.size, frm=(ctx.rank + 1) % ctx.size,
                    rows_in=ctx.rows_out)
        return back, None, None, None, None


def _token_table(layout: PackedLayout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample index and position inside the sample of every token group rank ``rank`` holds."""
    view = PackedLayout(samples=layout.samples, group_size=layout.group_size, index_in_group=rank)
    return view.local_sample_index(), view.local_positions()


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: PackedLayout,
                   group: dist.ProcessGroup | None, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries to every key of their samples, keys and values passed
    around the ring.

    Args:
        q: This rank's queries ``(local_tokens, heads, head_dim)`` (its piece of every sample).
        k: Its keys, same shape (key/value heads repeated to the query heads beforehand).
        v: Its values, same shape.
        layout: The micro-batch's placement on the ring (``group_size`` ranks).
        group: The ring's process group (None only for a ring of one).
        causal: A token sees only keys at or before its position in its sample.
        scale: Factor of ``q k^T`` (default ``1 / sqrt(head_dim)``).

    Returns:
        ``(local_tokens, heads, head_dim)``.

    Raises:
        ValueError: for a layout that is not this rank's, or a ring without a process group.
    """
    size, rank = layout.group_size, layout.index_in_group
    if q.shape[0] != layout.local_tokens or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} for "
                         f"{layout.local_tokens} local tokens")
    if size > 1 and group is None:
        raise ValueError(f"a ring of {size} ranks needs a process group")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_sample, q_pos = _token_table(layout, rank)
    qh = q.transpose(0, 1)  # (H, Tq, Dh)
    out = torch.zeros_like(qh)
    # Running max and log-sum of the softmax per (head, query); -inf until a key is seen.
    lse = torch.full(qh.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])
    for step in range(size):
        owner = (rank - step) % size  # whose keys and values are in hand
        incoming = layout.rank_tokens((rank - step - 1) % size)  # the next block's owner's piece
        nxt = _RingHop.apply(kv, group, rank, size, incoming) if step < size - 1 else None
        k_sample, k_pos = _token_table(layout, owner)
        mask = q_sample[:, None] == k_sample[None, :]
        if causal:
            mask &= k_pos[None, :] <= q_pos[:, None]
        if mask.any():
            kb, vb = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # (H, Tk, Dh)
            scores = (qh @ kb.transpose(1, 2)) * scale
            scores = scores.masked_fill(~mask.to(q.device)[None], float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)  # (H, Tq); -inf where a query sees none
            seen = torch.isfinite(block_lse)
            probs = torch.exp(scores - torch.where(seen, block_lse, 0.0)[..., None])
            block_out = probs @ vb
            new_lse = torch.logaddexp(lse, block_lse)
            safe = torch.where(torch.isfinite(new_lse), new_lse, 0.0)
            old_w = torch.where(torch.isfinite(lse), torch.exp(lse - safe), 0.0)[..., None]
            new_w = torch.where(seen, torch.exp(block_lse - safe), 0.0)[..., None]
            out = out * old_w + block_out * new_w
            lse = new_lse
        if nxt is not None:
            # Every hop's output joins the graph (a zero term where its block is masked out), so
            # every rank runs every reverse hop in the same order: none waits on a peer for good.
            out = out + 0.0 * nxt.sum()
            kv = nxt
    return out.transpose(0, 1)
