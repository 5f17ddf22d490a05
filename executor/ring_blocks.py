"""What both ring schedules share: a block's mask, its attention merged by log-sum-exp, its
gradients, the p2p requests, and the record of the ring's events.

:mod:`executor.ring` passes the key/value blocks round the ring (every step, full attention);
:mod:`executor.ring_window` sends each block only to the positions whose windows reach it. Both
attend a block with :func:`merge` (the online softmax of Milakov & Gimelshein 2018, as
FlashAttention does) and take its gradients with :func:`block_grads` (FlashAttention-2's, Dao
2023, Alg. 2, from the saved output and log-sum-exp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from executor.ring_layout import RingLayout

RingEvent = tuple[str, int, str]
"""``(pass, step, what)``: pass ``forward`` or ``backward``; what ``post kv`` / ``wait kv`` (a key/
value block's hop), ``post dkv`` / ``wait dkv`` (a gradient sum's hop; at the last step the hop
home), ``attend`` / ``attended`` (a block's attention or its gradients, begin and end), ``dq``
(the backward's query gradient of the block); the windowed ring (:mod:`executor.ring_window`)
also ``send kv`` / ``recv kv`` / ``send dkv`` / ``recv dkv`` for each transfer it posts at a step."""

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


def note(pass_: str, step: int, what: str) -> None:
    """Append an event while :func:`record_ring_events` records."""
    if _events is not None:
        _events.append((pass_, step, what))


class Pending:
    """The requests of posted transfers; :meth:`wait` before reading what they receive."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests

    def wait(self) -> None:
        for req in self.requests:
            req.wait()
        self.requests = []


def post_p2p(group: dist.ProcessGroup | None, sends: list[tuple[torch.Tensor, int]],
             recvs: list[tuple[torch.Tensor, int]]) -> Pending:
    """Post ``(tensor, group rank)`` sends and receives as one ``batch_isend_irecv`` (nothing posted
    for none); sources are made contiguous by the caller."""
    if not sends and not recvs:
        return Pending([])
    assert group is not None, "a hop needs the ring's process group (ring_attention checks it)"
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs]
    return Pending(list(dist.batch_isend_irecv(ops)))


def block_mask(layout: RingLayout, q_table: tuple[torch.Tensor, torch.Tensor], owner: int,
               causal: bool, window: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``(Tq, Tk)``: which keys of ring position ``owner``'s block (or of its ``rows``) each local
    query sees (its own sample; causal: at or before its position; windowed: fewer than ``window``
    positions before)."""
    q_sample, q_pos = q_table
    k_sample, k_pos = layout.ring_table(owner)
    if rows is not None:
        k_sample, k_pos = k_sample[rows], k_pos[rows]
    mask = q_sample[:, None] == k_sample[None, :]
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def merge(out: torch.Tensor, lse: torch.Tensor, qh: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
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


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation (and gradient-hop) dtype: fp32 for half precision, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def block_grads(qh: torch.Tensor, doh: torch.Tensor, delta: torch.Tensor, safe_lse: torch.Tensor,
                kv: torch.Tensor, mask: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's gradients: ``(dkv (2, Tk, H, Dh), dS (H, Tq, Tk), kb (H, Tk, Dh))`` from the
    queries ``qh`` and output gradients ``doh`` (H, Tq, Dh) in the accumulation dtype, ``delta =
    rowsum(dO * O)`` and the final log-sum-exp (H, Tq, 1); the caller adds ``dS kb * scale`` to the
    query gradient when it suits its schedule."""
    acc = qh.dtype
    kb, vb = kv[0].transpose(0, 1).to(acc), kv[1].transpose(0, 1).to(acc)  # (H, Tk, Dh)
    scores = ((qh @ kb.transpose(1, 2)) * scale).masked_fill(~mask[None], float("-inf"))
    probs = torch.exp(scores - safe_lse)  # P of the final softmax; 0 where masked
    d_scores = probs * (doh @ vb.transpose(1, 2) - delta)  # dS = P * (dP - rowsum(dO * O))
    dkv = torch.stack([((d_scores.transpose(1, 2) @ qh) * scale).transpose(0, 1),
                       (probs.transpose(1, 2) @ doh).transpose(0, 1)])
    return dkv, d_scores, kb


def output_grads(grads: tuple[torch.Tensor | None, ...], o: torch.Tensor, acc: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dO (H, Tq, Dh), delta (H, Tq, 1))`` in the accumulation dtype from a ring's output
    gradients ``(dO, dlse)`` (either may be None: not used downstream). ``delta = rowsum(dO * O) -
    dlse``: a gradient on the log-sum-exp adds ``P * dlse`` to every score's (``d lse / d s = P``),
    which is what the sinks' correction (:func:`apply_sinks`) sends back."""
    grad_o, grad_lse = grads
    oh = o.transpose(0, 1).to(acc)
    doh = torch.zeros_like(oh) if grad_o is None else grad_o.transpose(0, 1).to(acc)
    delta = (doh * oh).sum(-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc)[..., None]
    return doh, delta


def backward_start(q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, grads: tuple[torch.Tensor | None, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every ring's backward starts from, in the accumulation dtype: ``(qh (H, Tq, Dh), dO,
    delta (:func:`output_grads`), the log-sum-exp with empty rows at 0 (H, Tq, 1), dq = 0)``."""
    acc = acc_dtype(q.dtype)
    qh = q.transpose(0, 1).to(acc)
    doh, delta = output_grads(grads, o, acc)
    safe_lse = torch.where(torch.isfinite(lse), lse, 0.0).to(acc)[..., None]
    return qh, doh, delta, safe_lse, torch.zeros_like(qh)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention sinks on a ring's output ``(Tq, H, Dh)`` and log-sum-exp ``(H, Tq)``: a learned
    logit per head (gpt-oss, ``sinks (H,)``) joins every query's softmax and carries no value, so
    ``o' = o e^lse / (e^lse + e^sink) = o sigmoid(lse - sink)``; autograd takes the sinks'
    gradients and sends the log-sum-exp's back into the ring (:func:`output_grads`). A sink adds
    no key or value: no ring step depends on it."""
    if sinks is None:
        return out
    weight = torch.sigmoid(lse.to(sinks.dtype) - sinks[:, None]).transpose(0, 1)  # (Tq, H)
    return out * weight.to(out.dtype)[..., None]
