"""Groups being filled by the heuristic and its searches: micro-batches of sample indices.

A ``GroupState`` holds a group's micro-batches of sample indices (each sample at its cheapest
fitting policy for the group's size, from the cost table) and the free bytes of each;
``group_time`` prices it, ``repack`` packs it first-fit-decreasing when that needs fewer
micro-batches, ``insert_sample`` / ``remove_sample`` move one sample in or out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.costs import CostTable
from planner.search.intra import intra_layout


@dataclass(slots=True)
class GroupState:
    """A group being filled: its micro-batches and their free memory."""

    size: int
    col: int
    first_rank: int
    load_s: float = 0.0
    mbs: list[list[int]] = field(default_factory=list)
    free_bytes: list[float] = field(default_factory=list)

    def room(self, mem: float) -> int:
        """Index of the first micro-batch with room for ``mem`` bytes, or -1."""
        for m, free in enumerate(self.free_bytes):
            if free >= mem:
                return m
        return -1


def group_time(table: CostTable, g: GroupState) -> float:
    """A group's time: its samples at ``k_min`` plus its size's micro-batch overhead per
    micro-batch; with ``table.intra_policies``, the time of its best split and policies
    (``intra.intra_layout``, at most the former)."""
    if table.intra_policies:
        return intra_layout(table, g.col, [i for mb in g.mbs for i in mb])[0]
    cls = table.classes.class_of
    time_c = table.column(g.col)[4]  # lists: no numpy scalar per sample
    return (sum([time_c[cls[i]] for mb in g.mbs for i in mb])
            + float(table.overhead_s_by_size[g.col]) * len(g.mbs))


def repack(table: CostTable, g: GroupState) -> None:
    """Repack a group's samples first-fit-decreasing by memory when that opens fewer batches."""
    cls = table.classes.class_of
    mem_c = table.column(g.col)[5]
    items = sorted((i for mb in g.mbs for i in mb), key=lambda i: (-mem_c[cls[i]], i))
    mbs: list[list[int]] = []
    free: list[float] = []
    for i in items:
        mem = mem_c[cls[i]]
        for m, f in enumerate(free):
            if f >= mem:
                mbs[m].append(i)
                free[m] -= mem
                break
        else:
            mbs.append([i])
            free.append(table.budget_bytes - mem)
    if len(mbs) < len(g.mbs):
        g.mbs, g.free_bytes = mbs, free
    g.load_s = group_time(table, g)


def insert_sample(table: CostTable, g: GroupState, i: int) -> None:
    """Put sample ``i`` in the group's first micro-batch with room (a new one if none)."""
    mem = table.column(g.col)[5][table.classes.class_of[i]]
    m = g.room(mem)
    if m < 0:
        g.mbs.append([i])
        g.free_bytes.append(table.budget_bytes - mem)
    else:
        g.mbs[m].append(i)
        g.free_bytes[m] -= mem


def remove_sample(table: CostTable, g: GroupState, i: int) -> None:
    """Take sample ``i`` out of the group (an emptied micro-batch goes).

    Raises:
        AssertionError: when the sample is not in the group.
    """
    for m, mb in enumerate(g.mbs):
        if i in mb:
            mb.remove(i)
            g.free_bytes[m] += table.column(g.col)[5][table.classes.class_of[i]]
            if not mb:
                del g.mbs[m]
                del g.free_bytes[m]
            return
    raise AssertionError(f"sample {i} is not in the group")
