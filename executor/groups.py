"""The process-group registry: every group a plan may use, created once at start-up.

Plans partition the world into contiguous blocks of ranks (not necessarily aligned: a plan
``1+2+1`` uses ranks ``[1, 2]``). The registry creates, in the same order on every rank, one
process group for every contiguous block of every allowed size larger than one, with plain
``dist.new_group`` (a collective over the whole world; ``use_local_synchronization=True`` can
deadlock on gloo when groups overlap). A group of one rank needs no process group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch.distributed as dist

from planner.plan import GroupPlan

logger = logging.getLogger(__name__)


class GroupRegistry:
    """Owns the SP process groups of one world; hands them out per step."""

    def __init__(self, *, world_size: int, rank: int, group_sizes: Iterable[int],
                 backend: str | None = None) -> None:
        """Create the groups. Every rank must call this with the same arguments.

        Args:
            world_size: Ranks in the world ``N``.
            rank: This rank.
            group_sizes: Sizes plans may use (e.g. the model's allowed Ulysses sizes);
                sizes above ``world_size`` are ignored.
            backend: Backend of the new groups (default: the world's).

        Raises:
            ValueError: for a non-positive size, a rank outside the world, or a world that does
                not match ``torch.distributed``'s when it is initialised.
        """
        if world_size <= 0:
            raise ValueError(f"world_size must be positive, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside the world of {world_size}")
        sizes = sorted(set(group_sizes))
        if not sizes or sizes[0] <= 0:
            raise ValueError(f"group_sizes must be positive, got {sizes}")
        self.world_size = world_size
        self.rank = rank
        self.sizes = tuple(s for s in sizes if s <= world_size)
        """Allowed group sizes within this world."""
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        needs_dist = any(s > 1 for s in self.sizes)
        if needs_dist:
            if not dist.is_initialized():
                raise ValueError("torch.distributed is not initialised; call init_process_group first")
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise ValueError(f"registry for rank {rank} of {world_size} but torch.distributed is "
                                 f"rank {dist.get_rank()} of {dist.get_world_size()}")
        start = time.perf_counter()
        self.num_groups = 0
        """Process groups created over the world (every contiguous block of every size > 1)."""
        for size in self.sizes:
            if size == 1:
                continue
            for first in range(world_size - size + 1):
                ranks = list(range(first, first + size))
                group = dist.new_group(ranks=ranks, backend=backend)
                self.num_groups += 1
                if rank in ranks:
                    self._groups[(first, size)] = group
        self.creation_time_s = time.perf_counter() - start
        """Wall time this rank spent creating the groups."""
        logger.info("rank %d: %d SP groups over sizes %s (%d with this rank) in %.3f s", rank, self.num_groups,
                    self.sizes, len(self._groups), self.creation_time_s)

    def check_layout(self, group_sizes: Sequence[int]) -> None:
        """Check that every group of a plan (sizes in rank order) is one of the registered groups.

        Every rank holds the sizes of all groups (``RankPlan.group_sizes``), so every rank
        raises together, before any collective of the step (no rank waits for another).

        Raises:
            ValueError: for sizes that do not add up to the world or a size not registered.
        """
        if sum(group_sizes) != self.world_size or any(d <= 0 for d in group_sizes):
            raise ValueError(f"plan group sizes {list(group_sizes)} do not partition a world of {self.world_size}")
        first = 0
        for size in group_sizes:
            if size not in self.sizes:
                raise ValueError(f"the plan's group of ranks {first}..{first + size - 1} has size {size}, not one "
                                 f"of the registered sizes {list(self.sizes)}")
            first += size

    def group_for(self, group: GroupPlan) -> dist.ProcessGroup | None:
        """The process group of a planned group this rank belongs to (``None`` for size one).

        Raises:
            ValueError: when this rank is not in the group or its size was not registered.
        """
        if self.rank not in group.ranks:
            raise ValueError(f"rank {self.rank} is not in planned group {group.ranks}")
        if group.size not in self.sizes:
            raise ValueError(f"planned group {group.ranks} has size {group.size}, "
                             f"not one of the registered sizes {list(self.sizes)}")
        if group.size == 1:
            return None
        return self._groups[(group.first_rank, group.size)]
