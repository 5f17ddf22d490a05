"""Each layer's own attention for the ``transformers`` classes: sliding windows and attention sinks.

``transformers`` hands its attention function a layer's ``sliding_window`` (gpt-oss
``sliding_attention`` layers, Gemma 3's local layers, Mistral and Mixtral with ``sliding_window``
set; ``None`` on full layers) and gpt-oss's sinks as ``s_aux`` (one learned logit per query head).
The semantics are those of ``transformers`` 5.x:

- Window: query ``i`` sees key ``j`` of its sample when ``i - window < j <= i``
  (``masking_utils.sliding_window_overlay`` on top of the causal mask).
- Sinks: the sink's logit joins the softmax's denominator and carries no value
  (``models/gpt_oss/modeling_gpt_oss.py``, ``eager_attention_forward``: the logits get one more
  column, the sink, the softmax runs over it, the column is dropped), so the weights of the real keys
  sum to less than one: ``o_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h))``. The sink is
  seen whatever the window.

:func:`sample_attention` runs one sample's queries against its keys by position (causal, window),
the sink as one more key: every query gets one more channel, 1, the virtual key holds
``sink_h / scale`` there and 0 elsewhere, its value is 0, so its logit is exactly ``sink_h`` and the
real keys' logits are unchanged; the sink's gradient flows through that key.
:func:`packed_layer_attention` does it for the packed head-sharded sequence of a Ulysses group
(whole samples, positions ``0..T-1``), :data:`QUERY_BLOCK_TOKENS` queries at a time with the keys
their window reaches, so a windowed layer's masks grow with ``T x window``, not ``T x T``. A full
layer without sinks keeps :func:`executor.attention.packed_attention` (``is_causal``, the fused
kernels).

In a Ulysses x ring group the ring runs both (``executor/ring.py``, ``window=`` and ``sinks=``);
:func:`local_sinks` picks the sinks of a rank's heads for either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from executor.layout import SampleShape


def check_window(window: int | None, *, where: str) -> int | None:
    """The window as an int (``None``: a full layer).

    Raises:
        ValueError: for a window that is not a positive integer, naming ``where`` (the layer).
    """
    if window is None:
        return None
    if isinstance(window, bool) or int(window) != window or int(window) <= 0:
        raise ValueError(f"{where}: sliding_window={window!r} must be a positive integer")
    return int(window)


def local_sinks(sinks: torch.Tensor | None, *, group_size: int, index_in_group: int) -> torch.Tensor | None:
    """The sinks of this rank's query heads after the Ulysses swap (rank ``i`` of ``d`` holds query
    heads ``i H/d .. (i+1) H/d - 1``, :func:`executor.ulysses.qkv_seq_to_head`)."""
    if sinks is None:
        return None
    per_rank = sinks.shape[0] // group_size
    return sinks[index_in_group * per_rank:(index_in_group + 1) * per_rank]


def sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Causal (optionally windowed, optionally with sinks) attention of one sample's queries to its keys.

    Args:
        q: ``(Tq, H, Dh)``.
        k: ``(Tk, H_kv, Dh)``; ``H_kv`` divides ``H`` (grouped-query attention).
        v: Like ``k``.
        q_pos: Position in the sample of every query ``(Tq,)``.
        k_pos: Position in the sample of every key ``(Tk,)``.
        window: Keys with ``q_pos - window < k_pos`` only (``None``: all keys up to the query).
        sinks: One logit per query head ``(H,)`` that joins every softmax's denominator, or ``None``.
        scale: Factor of ``q k^T``.

    Returns:
        ``(Tq, H, Dh)``.
    """
    qp, kp = q_pos.to(q.device)[:, None], k_pos.to(q.device)[None, :]
    mask = kp <= qp
    if window is not None:
        mask &= kp > qp - window
    heads = q.shape[1]
    gqa = k.shape[1] != heads
    if sinks is not None:
        # The sink as a virtual key (see the module docstring): per query head, so keys and values
        # are taken per query head first.
        if gqa:
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
            gqa = False
        q = torch.cat([q, q.new_ones((*q.shape[:2], 1))], dim=-1)
        sink_key = torch.cat([k.new_zeros((1, heads, k.shape[-1])), (sinks.to(k.dtype) / scale).view(1, heads, 1)],
                             dim=-1)
        k = torch.cat([torch.cat([k, k.new_zeros((*k.shape[:2], 1))], dim=-1), sink_key])
        v = torch.cat([v, v.new_zeros((1, *v.shape[1:]))])
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


QUERY_BLOCK_TOKENS = 1024
"""Queries per attention call of :func:`packed_layer_attention`: a call's mask is at most this many
rows by the keys the block sees (``block + window - 1`` on a windowed layer), never ``T x T``."""


def packed_layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           samples: tuple[SampleShape, ...], window: int | None,
                           sinks: torch.Tensor | None, scale: float,
                           block_tokens: int = QUERY_BLOCK_TOKENS) -> torch.Tensor:
    """:func:`sample_attention` over a packed sequence of whole samples (the head-sharded side of
    Ulysses): ``(total_tokens, H, Dh)`` in and out. Each sample's queries go ``block_tokens`` at a
    time, each block with the keys it can see (from ``start - window + 1`` on a windowed layer)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens} must be positive")
    outs, start = [], 0
    for shape in samples:
        for first in range(0, shape.tokens, block_tokens):
            last = min(first + block_tokens, shape.tokens)
            key_first = 0 if window is None else max(0, first - window + 1)
            q_pos, k_pos = torch.arange(first, last), torch.arange(key_first, last)
            keys = slice(start + key_first, start + last)
            outs.append(sample_attention(q[start + first:start + last], k[keys], v[keys], q_pos=q_pos, k_pos=k_pos,
                                         window=window, sinks=sinks, scale=scale))
        start += shape.tokens
    if start != q.shape[0]:
        raise ValueError(f"packed attention: {q.shape[0]} tokens but the samples hold {start}")
    return torch.cat(outs, dim=0)
