"""What a model needs to run one micro-batch on one rank of its group."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor.layout import PackedLayout
from executor.ulysses import Group


@dataclass(kw_only=True, frozen=True, slots=True)
class SPContext:
    """Sequence-parallel context of one micro-batch (or a subset of its samples)."""

    layout: PackedLayout
    """Token placement in the group."""
    group: Group | None
    """The group's process group (or its single-process stand-in, ``ulysses.EmulatedGroup``);
    ``None`` for a group of one rank."""

    def __post_init__(self) -> None:
        if self.layout.group_size > 1 and self.group is None:
            raise ValueError(f"a group of size {self.layout.group_size} needs a process group")

    def subset(self, sample_indices: Sequence[int]) -> SPContext:
        """The context of some of the samples (same group)."""
        return SPContext(layout=self.layout.subset(sample_indices), group=self.group)

    def packed_positions(self) -> torch.Tensor:
        """Position inside its sample of every token of the packed (head-sharded) sequence."""
        return _packed_positions(self.layout)

    def local_positions(self) -> torch.Tensor:
        """Position inside its sample of every local (sequence-sharded) token."""
        return _local_positions(self.layout)


@functools.lru_cache(maxsize=256)
def _packed_positions(layout: PackedLayout) -> torch.Tensor:
    return torch.cat([torch.arange(s.tokens) for s in layout.samples])


@functools.lru_cache(maxsize=256)
def _local_positions(layout: PackedLayout) -> torch.Tensor:
    return layout.local_positions()
