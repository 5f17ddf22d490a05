"""``naive``: SP size 1, samples dealt round-robin in sampler order (a sensitivity row only).

Each rank is a group; sample ``i`` goes to rank ``i mod N``; each rank's samples are packed
first-fit (in sampler order) at their cheapest policy that fits alone. Nothing balances the
load, so this is never a headline comparison.
"""

from __future__ import annotations

from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.common import first_fit, fixed_layout
from planner.costs import CostTable


def naive_draft(table: CostTable, *, seed: int = 0,
                reference: Sample | None = None) -> Draft | None:
    """The naive draft (None when SP size 1 is not allowed or a sample does not fit one rank).

    Args:
        table: The batch's cost table.
        seed: Unused (the baseline is deterministic); the registry's signature.
        reference: Unused (the registry's signature).
    """
    del seed, reference
    groups = fixed_layout(table, 1)
    if groups is None:
        return None
    j = table.size_index(1)
    cls = table.classes.class_of
    mem, kmin = table.column(j)[5], table.column(j)[6]  # lists: no numpy scalar per sample
    if any(kmin[cls[i]] < 0 for i in range(len(table.samples))):
        return None
    n = len(groups)
    for g, group in enumerate(groups):
        items = list(range(g, len(table.samples), n))
        group.micro_batches = first_fit(items, [mem[cls[i]] for i in items], table.budget_bytes,
                                        [int(kmin[cls[i]]) for i in items])
    return groups
