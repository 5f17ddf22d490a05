"""Where a group sits and how it splits its attention: nodes spanned, Ulysses x ring layout.

A leaf module (no cost model): :func:`nodes_spanned` is the one definition of the nodes a run of
contiguous ranks touches, and :class:`GroupLayout` what the cost of a ``u x r`` group
(``executor/ring_layout.py``: group rank ``g`` is ring position ``g // u``, Ulysses position
``g % u``, so each Ulysses subgroup is ``u`` consecutive ranks) needs of its placement.
"""

from __future__ import annotations

from dataclasses import dataclass


def nodes_spanned(*, first_rank: int, group_size: int, gpus_per_node: int) -> int:
    """Nodes touched by the contiguous ranks ``[first_rank, first_rank + group_size)``."""
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    last = first_rank + group_size - 1
    return last // gpus_per_node - first_rank // gpus_per_node + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupLayout:
    """A group's attention layout on its placement: Ulysses over ``ulysses_degree`` consecutive
    ranks, ring attention over ``ring_degree`` such rank-sets.

    Raises:
        ValueError: for a degree below 1 or a node count below 1.
    """

    ulysses_degree: int
    """``u``: ranks of one Ulysses subgroup (its all-to-alls)."""
    ring_degree: int = 1
    """``r``: rank-sets of the ring (1: pure Ulysses)."""
    alltoall_nodes: int = 1
    """Nodes the widest Ulysses subgroup spans (the all-to-alls' placement)."""
    ring_crosses_nodes: bool = False
    """Whether a hop of the ring crosses nodes (the whole group spans more than one node)."""

    def __post_init__(self) -> None:
        if self.ulysses_degree < 1 or self.ring_degree < 1 or self.alltoall_nodes < 1:
            raise ValueError(f"layout ulysses_degree={self.ulysses_degree} x ring_degree={self.ring_degree} "
                             f"over {self.alltoall_nodes} node(s): degrees and nodes must be >= 1")

    @property
    def group_size(self) -> int:
        """``d = u x r``."""
        return self.ulysses_degree * self.ring_degree

    @classmethod
    def place(cls, *, first_rank: int, group_size: int, ring_degree: int, gpus_per_node: int) -> GroupLayout:
        """The layout of a group of ``group_size`` contiguous ranks from ``first_rank``.

        Raises:
            ValueError: when ``ring_degree`` does not divide ``group_size``.
        """
        if ring_degree < 1 or group_size % ring_degree:
            raise ValueError(f"ring_degree={ring_degree} does not divide the group size {group_size}")
        u = group_size // ring_degree
        a2a_nodes = max(nodes_spanned(first_rank=first_rank + j * u, group_size=u, gpus_per_node=gpus_per_node)
                        for j in range(ring_degree))
        whole = nodes_spanned(first_rank=first_rank, group_size=group_size, gpus_per_node=gpus_per_node)
        return cls(ulysses_degree=u, ring_degree=ring_degree, alltoall_nodes=a2a_nodes,
                   ring_crosses_nodes=ring_degree > 1 and whole > 1)
