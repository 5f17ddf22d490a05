"""Ring attention under a sliding window: only the steps whose blocks some query's window reaches.

In a causal window of ``w`` tokens query ``q`` sees keys ``q - w + 1 .. q`` (transformers'
sliding-window mask). On a ring most blocks then hold no key any local query sees: with the
zig-zag chunks and chunks of at least ``w - 1`` tokens a position needs only its two neighbours'
blocks, with contiguous chunks only its predecessor's (``costmodel/ring/window.py`` counts them for
the cost model). A block passed round the ring would still travel through every position, so
here each block goes straight from its owner to the positions that need it: at step ``k`` ring
position ``j`` receives from ``j - k`` and sends to ``j + k``, and only the keys the receiver's
queries see
(:func:`executor.ring_layout.needed_rows`: under a 128-token window the last 127 keys of a
neighbour's chunk, not its whole block); nothing where none is seen. Both ends of a transfer ask
the same question of the same layout, so they agree on what travels and a skipped step is skipped
on both sides: no compute, no transfer, nothing left waiting.

Forward: the local block, then every needed remote block, each transfer posted one step ahead
of the compute it overlaps and merged by log-sum-exp (:func:`executor.ring_blocks.merge`).
Backward: the needed blocks come again the same way; each position computes a remote block's key
and value gradients and sends them straight back to the block's owner at the same step, which
adds them to its own rows. Every rank runs the same ``r`` steps in the same order and posts its
transfers at the same points of each step, so every pair of ranks posts its messages to each
other in the same order (gloo and NCCL match them in that order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from executor.ring_blocks import Pending, acc_dtype, backward_start, block_grads, block_mask, merge, note, post_p2p
from executor.ring_layout import RingLayout, needed_rows


def needed_steps(layout: RingLayout, *, causal: bool, window: int | None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(receive, send)`` rows per step ``k`` for this rank's ring position ``j``: the rows of
    ``j - k``'s block its queries see (what it receives), and the rows of its own block that
    ``j + k``'s queries see (what it sends); empty: no transfer. Step 0 is the local block (receive:
    the rows it attends; send: none)."""
    size, rank = layout.ring_degree, layout.ring_index
    receive = [needed_rows(layout, query_index=rank, key_index=(rank - k) % size, causal=causal, window=window)
               for k in range(size)]
    send = [needed_rows(layout, query_index=(rank + k) % size, key_index=rank, causal=causal, window=window)
            if k else torch.zeros(0, dtype=torch.long) for k in range(size)]
    return receive, send


class _Transfers:
    """One pass's key/value transfers, posted one step ahead (see the module docstring)."""

    def __init__(self, layout: RingLayout, group: dist.ProcessGroup | None, kv: torch.Tensor,
                 receive: list[torch.Tensor], send: list[torch.Tensor], pass_: str) -> None:
        self.layout, self.group, self.kv, self.pass_ = layout, group, kv.contiguous(), pass_
        self.receive, self.send = receive, send
        self.posted: dict[int, tuple[torch.Tensor | None, Pending]] = {}

    def post(self, step: int) -> None:
        size, rank = self.layout.ring_degree, self.layout.ring_index
        if not 0 < step < size:
            return
        sends, recvs, block = [], [], None
        if self.send[step].numel():  # only the keys the receiver's windows reach
            sends.append((self.kv.index_select(1, self.send[step].to(self.kv.device)).contiguous(),
                          (rank + step) % size))
            note(self.pass_, step, "send kv")
        if self.receive[step].numel():
            block = self.kv.new_empty((2, self.receive[step].numel(), *self.kv.shape[2:]))
            recvs.append((block, (rank - step) % size))
            note(self.pass_, step, "recv kv")
        self.posted[step] = (block, post_p2p(self.group, sends, recvs))

    def take(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The block of step ``step`` and its rows in the owner's block (None: the whole block, the
        local one at 0), its transfers waited for; None when nothing of it is seen."""
        if step == 0:
            return (self.kv, None) if self.receive[0].numel() else None
        block, pending = self.posted.pop(step)
        pending.wait()
        return None if block is None else (block, self.receive[step])


def _add_returned(dkv: torch.Tensor, returned: tuple[torch.Tensor | None, torch.Tensor, Pending]) -> None:
    """Wait for a step's gradient transfers; add the gradients of the rows of this position's block
    it received."""
    part, rows, pending = returned
    pending.wait()
    if part is not None:
        dkv.index_add_(1, rows.to(dkv.device), part)


class _WindowedRing(torch.autograd.Function):
    """The windowed ring, forward and backward (the module docstring's schedule)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RingLayout,
                group: dist.ProcessGroup | None, causal: bool, scale: float, window: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        size, rank = layout.ring_degree, layout.ring_index
        receive, send = needed_steps(layout, causal=causal, window=window)
        q_table = layout.ring_table(rank)
        qh = q.transpose(0, 1)  # (H, Tq, Dh)
        out = torch.zeros_like(qh)
        lse = torch.full(qh.shape[:2], float("-inf"), dtype=q.dtype, device=q.device)
        transfers = _Transfers(layout, group, torch.stack([k, v]), receive, send, "forward")
        for step in range(size):
            taken = transfers.take(step)
            transfers.post(step + 1)
            if taken is None:
                continue
            block, rows = taken
            note("forward", step, "attend")
            mask = block_mask(layout, q_table, (rank - step) % size, causal, window, rows)
            out, lse = merge(out, lse, qh, block[0].transpose(0, 1), block[1].transpose(0, 1), mask, scale)
            note("forward", step, "attended")
        o = out.transpose(0, 1).contiguous()
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.set_materialize_grads(False)
        ctx.layout, ctx.group, ctx.causal, ctx.scale, ctx.window = layout, group, causal, scale, window
        ctx.steps = (receive, send)
        return o, lse

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        layout: RingLayout = ctx.layout
        size, rank = layout.ring_degree, layout.ring_index
        receive, send = ctx.steps
        acc = acc_dtype(q.dtype)
        q_table = layout.ring_table(rank)
        qh, doh, delta, safe_lse, dq = backward_start(q, o, lse, grads)
        dkv = torch.zeros((2, *k.shape), dtype=acc, device=q.device)  # this position's own block
        transfers = _Transfers(layout, ctx.group, torch.stack([k, v]), receive, send, "backward")
        returned: tuple[torch.Tensor | None, torch.Tensor, Pending] | None = None
        for step in range(size):
            taken = transfers.take(step)
            transfers.post(step + 1)
            owner = (rank - step) % size
            sends: list[tuple[torch.Tensor, int]] = []
            if taken is not None:
                block, rows = taken
                note("backward", step, "attend")
                mask = block_mask(layout, q_table, owner, ctx.causal, ctx.window, rows).to(q.device)
                block_dkv, d_scores, kb = block_grads(qh, doh, delta, safe_lse, block, mask, ctx.scale)
                note("backward", step, "attended")
                dq += (d_scores @ kb) * ctx.scale
                if step == 0:
                    dkv += block_dkv
                else:  # straight back to the block's owner
                    sends.append((block_dkv.contiguous(), owner))
                    note("backward", step, "send dkv")
            recvs: list[tuple[torch.Tensor, int]] = []
            rows_home = send[step]
            if rows_home.numel():  # the gradients of the rows this position sent at this step
                recvs.append((dkv.new_empty((2, rows_home.numel(), *dkv.shape[2:])), (rank + step) % size))
                note("backward", step, "recv dkv")
            if returned is not None:  # the previous step's, waited for after this step's compute
                _add_returned(dkv, returned)
            returned = (recvs[0][0] if recvs else None, rows_home, post_p2p(ctx.group, sends, recvs))
        if returned is not None:
            _add_returned(dkv, returned)
        return (dq.transpose(0, 1).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def windowed_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: RingLayout,
                            group: dist.ProcessGroup | None, causal: bool, scale: float,
                            window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring of :func:`executor.ring.ring_attention` that runs only the needed steps (arguments
    checked there): its output and log-sum-exp ``(H, Tq)``."""
    out, lse = _WindowedRing.apply(q, k, v, layout, group, causal, scale, window)
    return out, lse
