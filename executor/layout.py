"""Where each token of a micro-batch lives inside a sequence-parallel group.

A micro-batch packs whole samples. Inside a group of ``d`` ranks every sample is cut into
``d`` contiguous pieces (``tokens // d`` each, the first ``tokens % d`` pieces one token
longer), so uneven lengths are handled without padding and every rank holds ``1/d`` of every
sample (balanced attention work). A rank's local tensor is its pieces, sample after sample.

Around attention, Ulysses swaps the sequence shard for a head shard: every rank then holds the
whole packed sequence (sample after sample, each sample contiguous) for ``H/d`` heads. The
all-to-all delivers it rank after rank; ``gather_index`` reorders that into sample order and
``scatter_index`` is its inverse (see :mod:`executor.ulysses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True, frozen=True, slots=True)
class SampleShape:
    """Shape of one sample as the model sees it."""

    tokens: int
    """Tokens in the sample (``frames * spatial`` for 2D samples)."""
    frames: int = 1
    """Frames (1 for 1D samples)."""

    def __post_init__(self) -> None:
        if self.tokens <= 0:
            raise ValueError(f"tokens must be positive, got {self.tokens}")
        if self.frames <= 0 or self.tokens % self.frames != 0:
            raise ValueError(f"tokens={self.tokens} is not a positive multiple of frames={self.frames}")

    @property
    def spatial(self) -> int:
        """Tokens per frame."""
        return self.tokens // self.frames


def piece_sizes(tokens: int, group_size: int) -> list[int]:
    """Tokens of each of the ``group_size`` pieces of a sample (uneven when not divisible)."""
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    base, extra = divmod(tokens, group_size)
    return [base + (1 if r < extra else 0) for r in range(group_size)]


class PiecewiseTokens:
    """Token counts and local rows of a layout whose samples are cut into per-rank pieces: what
    :class:`PackedLayout` and :class:`executor.ring_layout.RingLayout` share (both set
    ``samples``, ``pieces`` and ``index_in_group``)."""

    __slots__ = ()
    samples: tuple[SampleShape, ...]
    pieces: tuple[tuple[int, ...], ...]
    index_in_group: int

    @property
    def num_samples(self) -> int:
        """Samples in the layout."""
        return len(self.samples)

    @property
    def total_tokens(self) -> int:
        """Tokens of all samples (the packed sequence every rank holds after a Ulysses swap)."""
        return sum(s.tokens for s in self.samples)

    def rank_tokens(self, rank: int) -> int:
        """Tokens group rank ``rank`` holds in sequence-sharded form."""
        return sum(p[rank] for p in self.pieces)

    @property
    def local_tokens(self) -> int:
        """Tokens this rank holds in sequence-sharded form."""
        return self.rank_tokens(self.index_in_group)

    def local_sample_index(self) -> torch.Tensor:
        """Index of the sample of every local token (local order)."""
        return torch.cat([torch.full((self.pieces[s][self.index_in_group],), s, dtype=torch.long)
                          for s in range(self.num_samples)])

    def local_rows(self, sample_indices: Sequence[int]) -> torch.Tensor:
        """Rows of the local tensor that hold the given samples' pieces (in the given order)."""
        starts = [0]
        for s in range(self.num_samples):
            starts.append(starts[-1] + self.pieces[s][self.index_in_group])
        parts = [torch.arange(starts[s], starts[s + 1]) for s in sample_indices]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(kw_only=True, frozen=True, slots=True)
class PackedLayout(PiecewiseTokens):
    """Token placement of one micro-batch (or a subset of its samples) on one rank of a group."""

    samples: tuple[SampleShape, ...]
    """The samples, in micro-batch order."""
    group_size: int
    """SP group size ``d``."""
    index_in_group: int
    """This rank's position in its group, ``0..d-1``."""
    pieces: tuple[tuple[int, ...], ...] = field(init=False)
    """``pieces[s][r]``: tokens of sample ``s`` held by group rank ``r``."""

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a layout needs at least one sample")
        if not 0 <= self.index_in_group < self.group_size:
            raise ValueError(f"index_in_group={self.index_in_group} outside group of {self.group_size}")
        object.__setattr__(
            self, "pieces", tuple(tuple(piece_sizes(s.tokens, self.group_size)) for s in self.samples)
        )

    # ------------------------------------------------------------ sizes
    def piece_range(self, sample: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's piece inside sample ``sample``."""
        sizes = self.pieces[sample]
        start = sum(sizes[: self.index_in_group])
        return start, start + sizes[self.index_in_group]

    def sample_offsets(self) -> list[int]:
        """Start of each sample in the packed full sequence, plus the total at the end."""
        offsets = [0]
        for s in self.samples:
            offsets.append(offsets[-1] + s.tokens)
        return offsets

    # ------------------------------------------------------- index maps
    def gather_index(self) -> torch.Tensor:
        """For each packed position (sample order), its row in the rank-major all-to-all output."""
        # Rank-major order: rank 0's pieces sample after sample, then rank 1's, ...
        rank_major_start: list[list[int]] = [[0] * self.group_size for _ in self.samples]
        cursor = 0
        for r in range(self.group_size):
            for s in range(self.num_samples):
                rank_major_start[s][r] = cursor
                cursor += self.pieces[s][r]
        index: list[int] = []
        for s in range(self.num_samples):
            for r in range(self.group_size):
                start = rank_major_start[s][r]
                index.extend(range(start, start + self.pieces[s][r]))
        return torch.tensor(index, dtype=torch.long)

    def scatter_index(self) -> torch.Tensor:
        """Inverse of :meth:`gather_index`: for each rank-major row, its packed position."""
        gather = self.gather_index()
        inverse = torch.empty_like(gather)
        inverse[gather] = torch.arange(gather.numel())
        return inverse

    def local_positions(self) -> torch.Tensor:
        """Position inside its sample of every local token (local order)."""
        parts = [torch.arange(*self.piece_range(s)) for s in range(self.num_samples)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def local_spatial(self) -> torch.Tensor:
        """Tokens per frame of the sample of every local token (local order)."""
        parts = [torch.full((self.pieces[s][self.index_in_group],), shape.spatial, dtype=torch.long)
                 for s, shape in enumerate(self.samples)]
        return torch.cat(parts)

    def subset(self, sample_indices: Sequence[int]) -> PackedLayout:
        """The layout of some of the samples (same group, same per-sample pieces)."""
        return PackedLayout(samples=tuple(self.samples[s] for s in sample_indices),
                            group_size=self.group_size, index_in_group=self.index_in_group)

    def shard(self, full: torch.Tensor, sample: int) -> torch.Tensor:
        """This rank's piece of a full per-sample tensor (first dim = the sample's tokens)."""
        if full.shape[0] != self.samples[sample].tokens:
            raise ValueError(f"sample {sample}: tensor has {full.shape[0]} rows, "
                             f"expected {self.samples[sample].tokens} tokens")
        start, end = self.piece_range(sample)
        return full[start:end]
