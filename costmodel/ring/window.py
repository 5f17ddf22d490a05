"""Which ring steps a sliding-window layer runs: the remote blocks some query's window reaches.

In a causal window of ``w`` tokens query ``q`` sees keys ``q - w + 1 .. q`` (transformers'
sliding-window mask). A ring cuts every sample into chunks (``executor/ring_layout.py``): the
zig-zag layout cuts ``2r`` chunks of ``c = s/(2r)`` tokens and ring position ``i`` holds chunks
``i`` and ``2r - 1 - i``; the contiguous one cuts ``r`` chunks of ``c = s/r`` and position ``i``
holds chunk ``i``. A query of chunk ``a`` reaches a key of chunk ``a - g`` (``g >= 1`` chunks back)
only when the nearest such pair, ``(g - 1) c + 1`` tokens apart, is inside the window, so the
chunks a query chunk needs are ``a - G .. a`` with

    G = floor(1 + (w - 2) / c)    (at least 0, at most the chunks before it).

A ring step brings one position's block; it is needed when it holds one of the chunks the local
queries need, and every other step is skipped, both its attention and its hop (the executor sends
each needed block straight from its owner, ``executor/ring_window.py``, and of it only the keys
the receiver's windows reach: :func:`hop_tokens`). With ``c >= w - 1``
(``G = 1``: a 128-token window once chunks hold 127 tokens, samples of 1,016 tokens on a zig-zag
ring of 4) a zig-zag position needs its two neighbours' blocks (2 of ``r - 1`` remote steps; the
ends 1) and a contiguous one only its predecessor's (1 step). The cost model charges the busiest
position (the layer waits for it), for one layer call over several samples the union of their
needs: the needed sets grow as ``G`` does, so that is the need of the sample of the largest ``G``
(:func:`call_remote_steps`).

Gemma 3's 1,024-token and gpt-oss' 128-token windows skip most steps on long samples; gpt-oss'
attention sinks add no step: in transformers 5.24 (``modeling_gpt_oss.eager_attention_forward``)
a sink is one learned logit per head appended to each query's scores and dropped after the
softmax, with no key or value, so it depends on no block.
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.typing import ArrayLike, NDArray

CHUNKINGS = ("zigzag", "contiguous")
"""How a ring cuts a sample: ``2r`` zig-zag chunks (the executor's default) or ``r`` contiguous ones."""


def chunk_reach(tokens: ArrayLike, *, window: int, chunks: int) -> NDArray[np.int64]:
    """``G`` per sample: how many chunks before its own a query chunk's window reaches, for
    samples cut into ``chunks`` equal chunks (``c = s / chunks``); at most ``chunks - 1``.

    Raises:
        ValueError: for a window or a chunk count below 1, or a non-positive sample.
    """
    s = np.asarray(tokens, dtype=np.float64)
    if window < 1 or chunks < 1 or (s <= 0).any():
        raise ValueError(f"need window >= 1, chunks >= 1 and positive tokens; got window={window}, "
                         f"chunks={chunks}, tokens={s.tolist()}")
    c = s / chunks
    reach = np.floor(1.0 + (window - 2) / c)
    return np.clip(reach, 0, chunks - 1).astype(np.int64)


def _owner(chunk: int, ring_degree: int, chunking: str) -> int:
    if chunking == "contiguous":
        return chunk
    return chunk if chunk < ring_degree else 2 * ring_degree - 1 - chunk


def _local_chunks(position: int, ring_degree: int, chunking: str) -> tuple[int, ...]:
    if chunking == "contiguous":
        return (position,)
    return (position, 2 * ring_degree - 1 - position)


def needed_positions(position: int, *, reach: int, ring_degree: int, chunking: str = "zigzag") -> frozenset[int]:
    """Ring positions whose blocks the queries of ``position`` need at chunk reach ``reach``
    (``G``), its own included.

    Raises:
        ValueError: for an unknown chunking or a position outside the ring.
    """
    if chunking not in CHUNKINGS:
        raise ValueError(f"chunking must be one of {CHUNKINGS}, got {chunking!r}")
    if not 0 <= position < ring_degree:
        raise ValueError(f"position {position} is outside a ring of {ring_degree}")
    return frozenset(_owner(b, ring_degree, chunking)
                     for a in _local_chunks(position, ring_degree, chunking)
                     for b in range(max(0, a - reach), a + 1))


@functools.lru_cache(maxsize=4096)
def _busiest_remote(ring_degree: int, chunking: str, reach: int) -> int:
    """Remote steps of the busiest position at chunk reach ``reach`` (:func:`needed_positions` for
    every position at once: ``O(r^2)`` booleans)."""
    r = ring_degree
    pos = np.arange(r)[:, None]
    if chunking == "contiguous":
        chunk = np.arange(r)[None, :]
        owners = (chunk <= pos) & (chunk >= pos - reach)
    else:
        chunk = np.arange(2 * r)[None, :]
        mirror = 2 * r - 1 - pos
        needed = ((chunk <= pos) & (chunk >= pos - reach)) | ((chunk <= mirror) & (chunk >= mirror - reach))
        owners = needed[:, :r] | needed[:, r:][:, ::-1]  # chunk r + m belongs to position r - 1 - m
    owners[np.arange(r), np.arange(r)] = False
    return int(owners.sum(axis=1).max())


def remote_steps(tokens: ArrayLike, *, window: int, ring_degree: int, chunking: str = "zigzag") -> NDArray[np.int64]:
    """Per sample (alone in its call): remote ring steps the busiest position runs in a window of
    ``window`` tokens (of ``r - 1``; 0 for a ring of one).

    Raises:
        ValueError: for an unknown chunking, a ring degree or window below 1, or a non-positive sample.
    """
    if chunking not in CHUNKINGS:
        raise ValueError(f"chunking must be one of {CHUNKINGS}, got {chunking!r}")
    if ring_degree < 1:
        raise ValueError(f"ring_degree must be >= 1, got {ring_degree}")
    chunks = 2 * ring_degree if chunking == "zigzag" else ring_degree
    reach = chunk_reach(tokens, window=window, chunks=chunks)
    values, where = np.unique(reach, return_inverse=True)
    steps = np.array([_busiest_remote(ring_degree, chunking, int(g)) for g in values], dtype=np.int64)
    return steps[where].reshape(reach.shape)


def call_remote_steps(tokens: ArrayLike, *, window: int, ring_degree: int, chunking: str = "zigzag") -> int:
    """Remote steps the busiest position runs for one layer call over these samples: the needs of
    the sample of the largest reach (the needed sets are nested in the reach)."""
    steps = remote_steps(tokens, window=window, ring_degree=ring_degree, chunking=chunking)
    return int(steps.max()) if steps.size else 0


def hop_tokens(tokens: ArrayLike, *, window: int, ring_degree: int) -> NDArray[np.float64]:
    """Per sample: tokens whose keys and values one needed remote step brings, ``min(w - 1, s/r)``:
    the receiver's queries reach at most the ``w - 1`` keys before them (the executor sends only
    those, ``executor.ring_layout.needed_rows``), and a block holds ``s/r``. Exact for a chunk
    reach of one (each needed block's tail of ``w - 1``), an upper bound past it."""
    s = np.asarray(tokens, dtype=np.float64)
    return np.asarray(np.minimum(float(window - 1), s / ring_degree), dtype=np.float64)


def check_window(window: int | None) -> None:
    """Raise ValueError for a window that is set and not a positive integer."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive integer (tokens), got {window!r}")


__all__ = ["CHUNKINGS", "call_remote_steps", "check_window", "chunk_reach", "hop_tokens", "needed_positions",
           "remote_steps"]
