"""The process-group registry: every group a plan may use, created once at start-up.

Plans partition the world into contiguous blocks of ranks (not necessarily aligned: a plan
``1+2+1`` uses ranks ``[1, 2]``). The registry creates, in the same order on every rank, one
process group for every contiguous block of every allowed size larger than one, with plain
``dist.new_group`` (a collective over the whole world; ``use_local_synchronization=True`` can
deadlock on gloo when groups overlap). A group of one rank needs no process group.

Ulysses x ring layouts (``GroupPlan.ring_degree``, :mod:`executor.ring_layout`): for each layout
``(u, r)`` it is given, on every contiguous block of ``u x r`` ranks, the registry also creates the
block's ``r`` Ulysses subgroups (``u`` consecutive ranks) and its ``u`` rings (ranks ``i, i+u, ...``),
after the contiguous groups and in the same order on every rank, each set of ranks once (a
contiguous subgroup is one of the plain groups when its size is registered). A layout adds at most
``2 x world_size`` groups, so the set stays bounded and ``num_groups`` counts it.

Once all are created, every rank runs one all-reduce of a single element on each group it belongs
to, in creation order (:meth:`GroupRegistry._warm_up`), so that no group's first call is a ring's
batched p2p that only some of its ranks post. NCCL creates a group's communicator on its first call,
and ``torch.distributed.batch_isend_irecv``
(https://pytorch.org/docs/stable/distributed.html#torch.distributed.batch_isend_irecv) says: "if
this API call is the first collective call in the group passed to dist.P2POp, all ranks of the group
must participate in this API call; otherwise, the behavior is undefined. If this API call is not the
first collective call in the group, batched P2P operations involving only a subset of ranks of the
group are allowed." A sliding-window ring (:mod:`executor.ring_window`) posts a step's transfers only
on the ranks whose windows reach a block: at some steps some ranks of a ring post and others none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from executor.ring_layout import RingGroups, check_layout_degrees
from planner.plan import GroupPlan

logger = logging.getLogger(__name__)


class GroupRegistry:
    """Owns the SP process groups of one world; hands them out per step."""

    def __init__(self, *, world_size: int, rank: int, group_sizes: Iterable[int],
                 layouts: Iterable[tuple[int, int]] = (), backend: str | None = None) -> None:
        """Create the groups. Every rank must call this with the same arguments.

        Args:
            world_size: Ranks in the world ``N``.
            rank: This rank.
            group_sizes: Sizes plans may use (e.g. the model's allowed Ulysses sizes);
                sizes above ``world_size`` are ignored.
            layouts: Ulysses x ring layouts ``(ulysses_degree, ring_degree)`` plans may use besides
                pure Ulysses; their group sizes ``u x r`` are registered too (those above
                ``world_size`` are ignored).
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
        ring_layouts = sorted({(u, r) for u, r in layouts if r > 1})
        for u, r in ring_layouts:
            check_layout_degrees(group_size=u * r, ulysses_degree=u, ring_degree=r)
        self.world_size = world_size
        self.rank = rank
        self.layouts = tuple((u, r) for u, r in ring_layouts if u * r <= world_size)
        """Ulysses x ring layouts ``(u, r)`` with ``r > 1`` within this world."""
        self.sizes = tuple(sorted({s for s in sizes if s <= world_size} | {u * r for u, r in self.layouts}))
        """Allowed group sizes within this world."""
        self.ulysses_degrees = tuple(sorted({s for s in sizes if s <= world_size} | {u for u, _ in self.layouts}))
        """Degrees the groups split the attention heads over: every size of ``group_sizes`` (pure Ulysses)
        and the Ulysses degree ``u`` of every layout (a ring of ``u x r`` splits heads over ``u`` only),
        within this world; what a model's heads must allow (the integrations' ``prepare``)."""
        self._groups: dict[tuple[int, int], dist.ProcessGroup] = {}
        self._by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
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
                self._by_ranks[tuple(ranks)] = group
                if rank in ranks:
                    self._groups[(first, size)] = group
        self.num_ring_groups = 0
        """Of ``num_groups``, the subgroups created for the Ulysses x ring layouts alone."""
        for rank_set in self._layout_rank_sets():
            if rank_set not in self._by_ranks:
                self._by_ranks[rank_set] = dist.new_group(ranks=list(rank_set), backend=backend)
                self.num_groups += 1
                self.num_ring_groups += 1
        self.creation_time_s = time.perf_counter() - start
        """Wall time this rank spent creating the groups."""
        self.warmed_up: list[tuple[int, ...]] = []
        """Ranks of every group this rank ran its first collective on (:meth:`_warm_up`), in creation
        order: each group with this rank once."""
        start = time.perf_counter()
        self._warm_up()
        self.warm_up_time_s = time.perf_counter() - start
        """Wall time this rank spent on the groups' first collectives."""
        logger.info("rank %d: %d SP groups over sizes %s (%d with this rank) in %.3f s, first collectives on "
                    "%d in %.3f s", rank, self.num_groups, self.sizes, len(self._groups), self.creation_time_s,
                    len(self.warmed_up), self.warm_up_time_s)

    @classmethod
    def from_layouts(cls, *, world_size: int, rank: int, layouts: Iterable[Sequence[int]],
                     backend: str | None = None) -> GroupRegistry:
        """The registry of exactly the layouts an epoch declares (``PlannerClient.epoch_layouts``:
        ``(size, ulysses_degree, ring_degree)`` triples, the service's ``EpochStatus.layouts``), so
        that every plan of the epoch runs and no other group is created.

        Raises:
            ValueError: for a triple whose degrees do not multiply to its size (naming it), or an
                empty list; and as the constructor.
        """
        triples = [tuple(int(x) for x in t) for t in layouts]
        if not triples:
            raise ValueError("layouts is empty: an epoch declares at least the group size 1")
        for t in triples:
            if len(t) != 3 or t[1] * t[2] != t[0] or min(t) < 1:
                raise ValueError(f"layout {list(t)} is not (size, ulysses_degree, ring_degree) with "
                                 "ulysses_degree x ring_degree = size")
        # the layouts' sizes are registered from ``layouts``: a size declared only as a ring is no
        # Ulysses degree (``ulysses_degrees``)
        return cls(world_size=world_size, rank=rank, group_sizes=[d for d, _, r in triples if r == 1] or [1],
                   layouts=[(u, r) for _, u, r in triples], backend=backend)

    def _warm_up(self) -> None:
        """Run each new group's first collective: an all-reduce of one element (the module docstring
        says why), on the current CUDA device under NCCL (each rank has called
        ``torch.cuda.set_device``, as NCCL requires), else on the CPU.

        It runs on every backend: on gloo (which needs no warm-up) it costs a few milliseconds a
        group and connects the group at start-up instead of in the first step. The sum, the group's
        size, checks that the group links the ranks it should. Every rank visits its groups in the
        same (creation) order and each all-reduce waits only for the group's members, each of which
        has finished the earlier groups it belongs to, so no rank waits for one that cannot come.

        Raises:
            RuntimeError: when a group's all-reduce does not sum to its size.
        """
        for ranks, group in self._by_ranks.items():  # creation order, each set of ranks once
            if self.rank not in ranks:
                continue
            nccl = "nccl" in str(dist.get_backend(group))
            one = torch.ones(1, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
            dist.all_reduce(one, group=group)
            if int(one.item()) != len(ranks):
                raise RuntimeError(f"rank {self.rank}: the first all-reduce over ranks {list(ranks)} summed to "
                                   f"{one.item()}, not their number {len(ranks)}")
            self.warmed_up.append(ranks)

    def _layout_rank_sets(self) -> list[tuple[int, ...]]:
        """Every Ulysses subgroup and ring of every layout, in creation order (repeats included)."""
        sets: list[tuple[int, ...]] = []
        for u, r in self.layouts:
            for first in range(self.world_size - u * r + 1):
                if u > 1:
                    sets += [tuple(range(first + j * u, first + (j + 1) * u)) for j in range(r)]
                sets += [tuple(first + i + j * u for j in range(r)) for i in range(u)]
        return sets

    def check_layout(self, group_sizes: Sequence[int], ring_degrees: Sequence[int] | None = None) -> None:
        """Check that every group of a plan (sizes in rank order) is one of the registered groups.

        Every rank holds the sizes of all groups (``RankPlan.group_sizes``) and their ring degrees
        (``RankPlan.ring_degrees``, ``None``: all pure Ulysses), so every rank raises together,
        before any collective of the step (no rank waits for another).

        Raises:
            ValueError: for sizes that do not add up to the world, a size not registered or a
                Ulysses x ring layout not registered.
        """
        if sum(group_sizes) != self.world_size or any(d <= 0 for d in group_sizes):
            raise ValueError(f"plan group sizes {list(group_sizes)} do not partition a world of {self.world_size}")
        first = 0
        for size in group_sizes:
            if size not in self.sizes:
                raise ValueError(f"the plan's group of ranks {first}..{first + size - 1} has size {size}, not one "
                                 f"of the registered sizes {list(self.sizes)}")
            first += size
        if ring_degrees is None:
            return
        if len(ring_degrees) != len(group_sizes):
            raise ValueError(f"{len(ring_degrees)} ring degrees for {len(group_sizes)} groups")
        first = 0
        for size, r in zip(group_sizes, ring_degrees, strict=True):
            self._check_ring(first, size, r)
            first += size

    def _check_ring(self, first: int, size: int, ring_degree: int) -> None:
        if ring_degree == 1:
            return
        layout = (size // ring_degree, ring_degree)
        if size % ring_degree or layout not in self.layouts:
            raise ValueError(f"the plan's group of ranks {first}..{first + size - 1} has ring_degree={ring_degree}, "
                             f"not one of the registered layouts (ulysses_degree, ring_degree) {list(self.layouts)}")

    def group_for(self, group: GroupPlan) -> dist.ProcessGroup | RingGroups | None:
        """The process group of a planned group this rank belongs to (``None`` for size one; the
        Ulysses subgroup and ring of this rank for a group with ``ring_degree > 1``).

        Raises:
            ValueError: when this rank is not in the group or its size or layout was not registered.
        """
        if self.rank not in group.ranks:
            raise ValueError(f"rank {self.rank} is not in planned group {group.ranks}")
        if group.size not in self.sizes:
            raise ValueError(f"planned group {group.ranks} has size {group.size}, "
                             f"not one of the registered sizes {list(self.sizes)}")
        if group.size == 1:
            return None
        if group.ring_degree > 1:
            self._check_ring(group.first_rank, group.size, group.ring_degree)
            u, r, first = group.ulysses_degree, group.ring_degree, group.first_rank
            j, i = divmod(self.rank - first, u)
            ulysses = self._by_ranks[tuple(range(first + j * u, first + (j + 1) * u))] if u > 1 else None
            return RingGroups(ulysses=ulysses, ring=self._by_ranks[tuple(first + i + k * u for k in range(r))])
        return self._groups[(group.first_rank, group.size)]
