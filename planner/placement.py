"""Topology-aware placement of a multiset of group sizes onto contiguous rank blocks.

Rules: every group is a block of contiguous ranks; a group no larger than a node stays inside
one node. Groups larger than a node are laid out first from rank 0, largest first; the groups
that fit in a node are then packed first-fit-decreasing into what is left of each node. With
power-of-two sizes on power-of-two nodes this is simply "largest first", and every group of
size ``d`` starts at a multiple of ``d``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence


def place_groups(sizes: Sequence[int], *, num_gpus: int, gpus_per_node: int
                 ) -> list[tuple[int, int]] | None:
    """Place groups on ranks.

    Args:
        sizes: Group sizes (a multiset summing to ``num_gpus``).
        num_gpus: World size.
        gpus_per_node: Ranks per node.

    Returns:
        ``(size, first_rank)`` per group, ordered by first rank; None when the sizes cannot be
        placed under the rules.

    Raises:
        ValueError: when the sizes do not sum to the world size.
    """
    if sum(sizes) != num_gpus:
        raise ValueError(f"group sizes {sorted(sizes, reverse=True)} sum to {sum(sizes)}, "
                         f"not to the world size {num_gpus}")
    placed = _place_sorted(tuple(sorted(map(int, sizes), reverse=True)), num_gpus, gpus_per_node)
    return None if placed is None else list(placed)


@functools.lru_cache(maxsize=16)
def _place_sorted(ordered: tuple[int, ...], num_gpus: int, gpus_per_node: int
                  ) -> tuple[tuple[int, int], ...] | None:
    """``place_groups`` of sizes in decreasing order, memoised: the heuristic places each of its
    multisets for several LPT runs (11,000 groups at 16,384 ranks)."""
    large = [d for d in ordered if d > gpus_per_node]
    small = [d for d in ordered if d <= gpus_per_node]
    placed: list[tuple[int, int]] = []
    cursor = 0
    for d in large:
        placed.append((d, cursor))
        cursor += d
    # Free space of each node after the large groups: (start rank, free ranks).
    bins: list[list[int]] = []
    if cursor % gpus_per_node:
        node_end = (cursor // gpus_per_node + 1) * gpus_per_node
        bins.append([cursor, node_end - cursor])
        cursor = node_end
    while cursor < num_gpus:
        bins.append([cursor, gpus_per_node])
        cursor += gpus_per_node
    # First fit: bins before the first one with room for ``d`` stay too full for ``d`` (free
    # space only shrinks), so the scan resumes there while the size stays the same (sizes come
    # in decreasing order): O(bins) per distinct size instead of per group.
    start, last = 0, -1
    for d in small:
        if d != last:
            start, last = 0, d
        while start < len(bins) and bins[start][1] < d:
            start += 1
        if start == len(bins):
            return None
        b = bins[start]
        placed.append((d, b[0]))
        b[0] += d
        b[1] -= d
    placed.sort(key=lambda item: item[1])
    return tuple(placed)


def representable(total: int, sizes: Sequence[int]) -> bool:
    """True when ``total`` ranks can be split into groups of the given sizes."""
    if total == 0:
        return True
    reach = [False] * (total + 1)
    reach[0] = True
    for r in range(1, total + 1):
        reach[r] = any(d <= r and reach[r - d] for d in sizes)
    return reach[total]


def fill_ranks(total: int, sizes: Sequence[int]) -> list[int] | None:
    """Split ``total`` ranks into as few groups of the given sizes as possible (None if none)."""
    if total == 0:
        return []
    if total < 0:
        return None
    best: list[list[int] | None] = [None] * (total + 1)
    best[0] = []
    for r in range(1, total + 1):
        for d in sorted(sizes, reverse=True):
            prev = best[r - d] if d <= r else None
            if prev is not None and (best[r] is None or len(prev) + 1 < len(best[r] or [])):
                best[r] = [*prev, d]
    return best[total]
