"""What a model needs to run one micro-batch on one rank of its group.

A Ulysses x ring group (``GroupPlan.ring_degree > 1``, :mod:`executor.ring`) carries its
:class:`~executor.ring_layout.RingLayout` in ``ring`` and the ring's process group in
``ring_group``; ``layout`` and ``group`` are then its Ulysses part (this rank's ring position's
sub-samples over the ``u`` ranks and their subgroup), so the Ulysses all-to-alls run unchanged and
only the attention between them goes round the ring. Token positions and frame sizes come from
the ring layout (``local_positions``, ``local_spatial``, ``packed_positions``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor.layout import PackedLayout
from executor.ring_layout import RingGroups, RingLayout
from executor.ulysses import Group


@dataclass(kw_only=True, frozen=True, slots=True)
class SPContext:
    """Sequence-parallel context of one micro-batch (or a subset of its samples)."""

    layout: PackedLayout
    """Token placement in the group."""
    group: Group | None
    """The group's process group (or its single-process stand-in, ``ulysses.EmulatedGroup``);
    ``None`` for a group of one rank."""
    ring: RingLayout | None = None
    """The Ulysses x ring layout of a group with ``ring_degree > 1`` (``layout`` is then
    ``ring.ulysses_layout()``); ``None`` for a pure Ulysses group."""
    ring_group: dist.ProcessGroup | None = None
    """The ring's process group (the ``r`` ranks of this rank's Ulysses position)."""

    def __post_init__(self) -> None:
        if self.layout.group_size > 1 and self.group is None:
            raise ValueError(f"a group of size {self.layout.group_size} needs a process group")
        if self.ring is not None:
            if self.layout != self.ring.ulysses_layout():
                raise ValueError("a ring context's layout must be its ring layout's Ulysses part")
            if self.ring.ring_degree > 1 and self.ring_group is None:
                raise ValueError(f"a ring of {self.ring.ring_degree} needs a process group")

    @classmethod
    def for_ring(cls, layout: RingLayout, groups: RingGroups) -> SPContext:
        """The context of a rank of a Ulysses x ring group."""
        return cls(layout=layout.ulysses_layout(), group=groups.ulysses, ring=layout, ring_group=groups.ring)

    def subset(self, sample_indices: Sequence[int]) -> SPContext:
        """The context of some of the samples (same group)."""
        if self.ring is not None:
            ring = self.ring.subset(sample_indices)
            return SPContext(layout=ring.ulysses_layout(), group=self.group, ring=ring, ring_group=self.ring_group)
        return SPContext(layout=self.layout.subset(sample_indices), group=self.group)

    @property
    def placement(self) -> PackedLayout | RingLayout:
        """Where the micro-batch's whole samples lie over the group: the ring layout of a Ulysses x
        ring group (zig-zag chunks, :mod:`executor.ring_layout`), else :attr:`layout`. Its
        ``samples`` are the whole samples (``layout.samples`` of a ring group are the sub-samples)."""
        return self.ring if self.ring is not None else self.layout

    def shard(self, full: torch.Tensor, sample: int) -> torch.Tensor:
        """This rank's tokens of a whole-sample tensor (first dim = the sample's tokens), in local
        order, for any layout: inputs, labels, rotary tables and position embeddings cut this way
        follow the ranks' tokens (the executor cuts ``inputs`` and ``targets`` the same way).

        Raises:
            ValueError: when the tensor's first dim is not the sample's tokens.
        """
        return self.placement.shard(full, sample)

    def packed_positions(self) -> torch.Tensor:
        """Position inside its sample of every token of the packed (head-sharded) sequence."""
        if self.ring is not None:
            return self.ring.packed_positions()
        return _packed_positions(self.layout)

    def local_positions(self) -> torch.Tensor:
        """Position inside its sample of every local (sequence-sharded) token."""
        if self.ring is not None:
            return self.ring.local_positions()
        return _local_positions(self.layout)

    def local_spatial(self) -> torch.Tensor:
        """Tokens per frame of the sample of every local token (local order)."""
        return (self.ring if self.ring is not None else self.layout).local_spatial()


@functools.lru_cache(maxsize=256)
def _packed_positions(layout: PackedLayout) -> torch.Tensor:
    return torch.cat([torch.arange(s.tokens) for s in layout.samples])


@functools.lru_cache(maxsize=256)
def _local_positions(layout: PackedLayout) -> torch.Tensor:
    return layout.local_positions()
