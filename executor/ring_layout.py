"""Where each token lives in a group that splits attention as Ulysses x ring (issue 25).

A group of ``d = u x r`` ranks: group rank ``g`` is ring position ``j = g // u`` and Ulysses
position ``i = g % u``, so each Ulysses subgroup is ``u`` consecutive ranks (inside a node where
the group allows it) and each ring links the ranks of one Ulysses position across the ``r``
rank-sets. Every sample is cut into ``2r`` chunks (``piece_sizes(tokens, 2r)``); ring position
``j`` owns chunks ``j`` and ``2r-1-j`` (the zig-zag layout of public ring implementations, e.g.
zhuzilin/ring-flash-attention and Megatron-Core's context parallelism), so under a causal mask
every ring position does the same attention work: an early chunk with few keys before it is
paired with its mirror, which has many. The two chunks, in position order, form the ring
position's *sub-sample*; inside the ``u`` ranks of a ring position the sub-sample is cut into
``u`` contiguous pieces as :class:`executor.layout.PackedLayout` cuts a whole sample, and
Ulysses (:mod:`executor.ulysses`) swaps those pieces for heads, unchanged. ``chunking =
"contiguous"`` cuts ``r`` chunks instead, position ``j`` owning chunk ``j``: unbalanced under a
full causal mask, but under a sliding window each position then needs only its predecessor's
block (:func:`block_needed`, :mod:`executor.ring_window`).

:class:`RingLayout` answers the questions the executor and the models ask a ``PackedLayout``
(pieces per rank, local positions and rows, shards, subsets), so token weights, per-sample
checkpointing and position embeddings run as they do for Ulysses groups.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from executor.layout import PackedLayout, PiecewiseTokens, SampleShape, piece_sizes


@dataclass(kw_only=True, frozen=True, slots=True)
class RingGroups:
    """The two process groups a rank of a ``u x r`` group uses (``None`` for a degree of one)."""

    ulysses: dist.ProcessGroup | None
    """The ``u`` ranks of this rank's ring position (the all-to-alls)."""
    ring: dist.ProcessGroup | None
    """The ``r`` ranks of this rank's Ulysses position (the key/value hops)."""


def check_layout_degrees(*, group_size: int, ulysses_degree: int, ring_degree: int) -> None:
    """Check that a layout's degrees are positive and multiply to the group size.

    Raises:
        ValueError: naming the degrees and the group size.
    """
    if ulysses_degree < 1 or ring_degree < 1 or ulysses_degree * ring_degree != group_size:
        raise ValueError(f"attention layout ulysses_degree={ulysses_degree} x ring_degree={ring_degree} "
                         f"does not multiply to the group size {group_size}")


CHUNKINGS = ("zigzag", "contiguous")
"""How a ring cuts every sample: ``2r`` zig-zag chunks (the default) or ``r`` contiguous ones."""


def check_ring_chunks(tokens: Sequence[int], *, ring_degree: int, where: str = "", chunking: str = "zigzag") -> None:
    """Check that every sample can be cut into the ring's chunks (``2 x ring_degree`` zig-zag, or
    ``ring_degree`` contiguous).

    Raises:
        ValueError: naming the sample, its tokens, the ring degree (and ``where``, e.g. the group),
            or an unknown chunking.
    """
    if chunking not in CHUNKINGS:
        raise ValueError(f"{where}ring chunking must be one of {CHUNKINGS}, got {chunking!r}")
    if ring_degree <= 1:
        return
    chunks, how = (2 * ring_degree, "2 x ring_degree") if chunking == "zigzag" else (ring_degree, "ring_degree")
    for s, t in enumerate(tokens):
        if t < chunks:
            raise ValueError(f"{where}sample {s} has {t} tokens, fewer than the {chunks} chunks "
                             f"({how}={ring_degree}) a ring of {ring_degree} cuts every sample into")


@functools.lru_cache(maxsize=4096)
def sub_ranges(tokens: int, ring_degree: int, ring_index: int, chunking: str = "zigzag") -> tuple[tuple[int, int], ...]:
    """``(start, end)`` position ranges (ascending) of the chunks ring position ``ring_index`` owns
    in a sample of ``tokens``: two zig-zag chunks, or one contiguous chunk."""
    chunks = 2 * ring_degree if chunking == "zigzag" else ring_degree
    starts = [0]
    for size in piece_sizes(tokens, chunks):
        starts.append(starts[-1] + size)
    owned = (ring_index,) if chunking == "contiguous" else (ring_index, 2 * ring_degree - 1 - ring_index)
    return tuple((starts[c], starts[c + 1]) for c in owned)


@functools.lru_cache(maxsize=4096)
def _sub_positions(tokens: int, ring_degree: int, ring_index: int, chunking: str = "zigzag") -> torch.Tensor:
    """Positions (ascending) of the chunks ring position ``ring_index`` owns."""
    return torch.cat([torch.arange(a, b) for a, b in sub_ranges(tokens, ring_degree, ring_index, chunking)])


@dataclass(kw_only=True, frozen=True, slots=True)
class RingLayout(PiecewiseTokens):
    """Token placement of one micro-batch (or some of its samples) on one rank of a ``u x r`` group."""

    samples: tuple[SampleShape, ...]
    """The samples, in micro-batch order."""
    ulysses_degree: int
    """``u``: ranks that swap sequence for heads (divides the query heads)."""
    ring_degree: int
    """``r``: rank-sets the key/value blocks travel around."""
    index_in_group: int
    """This rank's position in its group, ``0..u*r-1``."""
    chunking: str = "zigzag"
    """How every sample is cut (:data:`CHUNKINGS`)."""
    pieces: tuple[tuple[int, ...], ...] = field(init=False)
    """``pieces[s][g]``: tokens of sample ``s`` held by group rank ``g``."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a layout needs at least one sample")
        size = self.ulysses_degree * self.ring_degree
        check_layout_degrees(group_size=size, ulysses_degree=self.ulysses_degree, ring_degree=self.ring_degree)
        if not 0 <= self.index_in_group < size:
            raise ValueError(f"index_in_group={self.index_in_group} outside group of {size}")
        check_ring_chunks([s.tokens for s in self.samples], ring_degree=self.ring_degree, chunking=self.chunking)
        u, r = self.ulysses_degree, self.ring_degree
        object.__setattr__(self, "pieces", tuple(
            tuple(p for j in range(r) for p in piece_sizes(self.sub_tokens(s, j), u))
            for s in range(len(self.samples))))

    # ------------------------------------------------------------ sizes
    @property
    def group_size(self) -> int:
        """``d = u x r``."""
        return self.ulysses_degree * self.ring_degree

    @property
    def ring_index(self) -> int:
        """This rank's ring position ``j``."""
        return self.index_in_group // self.ulysses_degree

    @property
    def ulysses_index(self) -> int:
        """This rank's position ``i`` inside its Ulysses subgroup."""
        return self.index_in_group % self.ulysses_degree

    def sub_tokens(self, sample: int, ring_index: int) -> int:
        """Tokens of sample ``sample`` that ring position ``ring_index`` owns (its chunks)."""
        return sum(b - a for a, b in self.sub_ranges(sample, ring_index))

    def sub_ranges(self, sample: int, ring_index: int) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` positions of the chunks of sample ``sample`` ring position
        ``ring_index`` owns (:func:`sub_ranges`)."""
        return sub_ranges(self.samples[sample].tokens, self.ring_degree, ring_index, self.chunking)

    def sample_offsets(self) -> list[int]:
        """Start of each sample in the packed full sequence, plus the total at the end."""
        offsets = [0]
        for s in self.samples:
            offsets.append(offsets[-1] + s.tokens)
        return offsets

    # ---------------------------------------------- the Ulysses and ring views
    def ulysses_layout(self) -> PackedLayout:
        """The Ulysses layout inside this rank's ring position: its sub-samples over ``u`` ranks."""
        return _ulysses_layout(self)

    def ring_tokens(self, ring_index: int) -> int:
        """Tokens of ring position ``ring_index``'s packed sub-samples (one key/value block)."""
        return sum(self.sub_tokens(s, ring_index) for s in range(self.num_samples))

    def ring_table(self, ring_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample index and position in its sample of every token of ring position ``ring_index``'s
        packed sub-samples (the head-sharded sequence after the Ulysses swap)."""
        return _ring_table(self, ring_index)

    def packed_positions(self) -> torch.Tensor:
        """Position in its sample of every token of this rank's packed sub-samples (for rotary
        embeddings on the head-sharded side)."""
        return self.ring_table(self.ring_index)[1]

    # ------------------------------------------------------- local tokens
    def _local_piece(self, sample: int) -> torch.Tensor:
        positions = _sub_positions(self.samples[sample].tokens, self.ring_degree, self.ring_index, self.chunking)
        sizes = piece_sizes(int(positions.numel()), self.ulysses_degree)
        start = sum(sizes[: self.ulysses_index])
        return positions[start:start + sizes[self.ulysses_index]]

    def local_positions(self) -> torch.Tensor:
        """Position inside its sample of every local token (local order)."""
        return torch.cat([self._local_piece(s) for s in range(self.num_samples)])

    def local_spatial(self) -> torch.Tensor:
        """Tokens per frame of the sample of every local token (local order)."""
        return torch.cat([torch.full((self.pieces[s][self.index_in_group],), shape.spatial, dtype=torch.long)
                          for s, shape in enumerate(self.samples)])

    def subset(self, sample_indices: Sequence[int]) -> RingLayout:
        """The layout of some of the samples (same group, same per-sample pieces)."""
        return RingLayout(samples=tuple(self.samples[s] for s in sample_indices),
                          ulysses_degree=self.ulysses_degree, ring_degree=self.ring_degree,
                          index_in_group=self.index_in_group, chunking=self.chunking)

    def shard(self, full: torch.Tensor, sample: int) -> torch.Tensor:
        """This rank's tokens of a full per-sample tensor (first dim = the sample's tokens)."""
        if full.shape[0] != self.samples[sample].tokens:
            raise ValueError(f"sample {sample}: tensor has {full.shape[0]} rows, "
                             f"expected {self.samples[sample].tokens} tokens")
        return full.index_select(0, self._local_piece(sample).to(full.device))


@functools.lru_cache(maxsize=256)
def _ulysses_layout(layout: RingLayout) -> PackedLayout:
    subs = tuple(SampleShape(tokens=layout.sub_tokens(s, layout.ring_index)) for s in range(layout.num_samples))
    return PackedLayout(samples=subs, group_size=layout.ulysses_degree, index_in_group=layout.ulysses_index)


@functools.lru_cache(maxsize=1024)
def _ring_table(layout: RingLayout, ring_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = [_sub_positions(s.tokens, layout.ring_degree, ring_index, layout.chunking) for s in layout.samples]
    index = [torch.full((int(p.numel()),), s, dtype=torch.long) for s, p in enumerate(positions)]
    return torch.cat(index), torch.cat(positions)


def needed_rows(layout: RingLayout, *, query_index: int, key_index: int, causal: bool,
                window: int | None = None) -> torch.Tensor:
    """Rows (ascending) of ring position ``key_index``'s block whose keys some query of position
    ``query_index`` sees: a key of the same sample with ``0 <= q - k < window`` (causal and
    windowed), ``q >= k`` (causal) or any (neither). Computed on the chunks' position ranges: over
    a query range ``[a, b)`` the keys seen are ``[a - window + 1, b)`` (causal: ``[0, b)``). Every
    rank of a ring answers the same for a pair of positions, so the sender of a block and its
    receiver agree on what travels.

    Raises:
        ValueError: for a window below 1, or a window on non-causal attention.
    """
    if window is not None and (window < 1 or not causal):
        raise ValueError(f"a ring's window must be a positive number of tokens on causal attention, got "
                         f"window={window!r} (causal={causal})")
    pieces, row = [], 0
    for s in range(layout.num_samples):
        queries = layout.sub_ranges(s, query_index)
        for c, e in layout.sub_ranges(s, key_index):
            seen = [(c, e)] if not causal else [
                (max(c, 0 if window is None else a - window + 1), min(e, b)) for a, b in queries]
            mask = torch.zeros(e - c, dtype=torch.bool)
            for lo, hi in seen:
                if lo < hi:
                    mask[lo - c:hi - c] = True
            pieces.append(torch.nonzero(mask).flatten() + row)
            row += e - c
    return torch.cat(pieces)


def block_needed(layout: RingLayout, *, query_index: int, key_index: int, causal: bool,
                 window: int | None = None) -> bool:
    """Whether some query of ring position ``query_index`` sees some key of position
    ``key_index``'s block (:func:`needed_rows` is not empty)."""
    return bool(needed_rows(layout, query_index=query_index, key_index=key_index, causal=causal,
                            window=window).numel())
