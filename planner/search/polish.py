"""Polishing another plan (e.g. a baseline's) with the search's own moves.

The plan's groups become search states (each packed first-fit-decreasing at ``k_min``), the
local search improves them, and the intra-step policies (``intra.intra_draft``) lay them out.
"""

from __future__ import annotations

import math

from planner.assemble import Draft, DraftGroup
from planner.costs import CostTable
from planner.search.group_state import GroupState, group_time, insert_sample, repack
from planner.search.intra import intra_draft
from planner.search.local_search import local_search


def states_of(table: CostTable, draft: list[tuple[int, int, list[int]]]) -> list[GroupState] | None:
    """Groups ``(size, first rank, sample indices)`` as search states, each packed
    first-fit-decreasing with every sample at its ``k_min`` (for seeding the local search with
    another plan, e.g. a baseline's); None when a sample does not fit its group's size column
    (the plan ran it under a layout the table's column does not have: the search cannot price it)."""
    cls = table.classes.class_of
    states = []
    for size, first_rank, members in draft:
        g = GroupState(size=size, col=table.size_index(size), first_rank=first_rank)
        mem = table.column(g.col)[5]  # a list: no numpy scalar per sample
        if any(mem[cls[i]] == math.inf for i in members):
            return None
        for i in sorted(members, key=lambda i: (-mem[cls[i]], i)):
            insert_sample(table, g, i)
        g.load_s = group_time(table, g)
        states.append(g)
    return states


def polish(table: CostTable, draft: Draft, *, max_moves: int, intra: bool) -> Draft | None:
    """Another plan's groups improved by the local search (then per-group repacking, and with
    ``intra`` the per-micro-batch policies of ``intra.intra_draft``), in the table's layouts; None
    when the table cannot hold one of its groups (``states_of``)."""
    states = states_of(table, [(g.size, g.first_rank, [i for mb in g.micro_batches for i, _ in mb])
                               for g in draft])
    if states is None:
        return None
    local_search(table, states, max_moves=max_moves)
    cls = table.classes.class_of
    out: Draft = []
    for g in states:
        repack(table, g)
        kmin = table.column(g.col)[6]
        mbs = [[(i, int(kmin[cls[i]])) for i in sorted(mb)] for mb in g.mbs]
        out.append(DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=mbs))
    return intra_draft(table, out) if intra else out
