"""``static-best``: the best fixed SP size with balanced assignment and packed micro-batches.

What a competent user does with one SP size for the whole step: for every allowed size ``d``
on which every sample fits, ``N // d`` groups (ranks left over stay idle); samples assigned
longest-processing-time first (by their time on ``d``) to the least-loaded group (LPT);
each group's samples packed first-fit decreasing by bytes into micro-batches, each sample at
its cheapest policy that fits it alone (``CostTable.k_min``). The size whose draft has the
lowest exact step time under the cost model is kept (ties: the smaller size).
"""

from __future__ import annotations

import heapq

import numpy as np

from costmodel.specs import Sample
from planner.assemble import BatchArrays, Draft, draft_step_time_s
from planner.baselines.common import fixed_layout, pack_cheapest
from planner.costs import CostTable


def lpt_draft(table: CostTable, *, group_size: int) -> Draft | None:
    """LPT-balanced, packed draft at one fixed size (None if a sample does not fit it)."""
    groups = fixed_layout(table, group_size)
    if groups is None:
        return None
    j = table.size_index(group_size)
    cls = table.classes.class_of
    time_j = table.column(j)[4]
    times = [time_j[c] for c in cls]
    if float("inf") in times:  # (== on floats: NaN never matches, as with any(t == inf))
        return None
    num_work = table.cost_model.cluster.num_gpus // group_size
    heap = [(0.0, g) for g in range(num_work)]  # (seconds so far, group)
    members: list[list[int]] = [[] for _ in range(num_work)]
    # Longest first, ties by index: a stable sort on the negated times.
    for i in np.argsort(-np.asarray(times), kind="stable").tolist():
        load, g = heap[0]  # (load, group) pairs are unique: the same pops as pop + push
        members[g].append(i)
        heapq.heapreplace(heap, (load + times[i], g))
    for g in range(num_work):
        if not pack_cheapest(table, groups[g], members[g]):
            return None
    return groups


def static_best_draft(table: CostTable, *, seed: int = 0,
              reference: Sample | None = None) -> Draft | None:
    """The best of ``lpt_draft`` over the allowed sizes (None if no size holds the batch).

    Args:
        table: The batch's cost table.
        seed: Unused (the baseline is deterministic); the registry's signature.
        reference: Unused (the registry's signature).
    """
    del seed, reference
    arrays = BatchArrays.of_classes(table.classes)
    num_gpus = table.cost_model.cluster.num_gpus
    floors: list[tuple[float, int]] = []
    class_of = np.asarray(table.classes.class_of, dtype=np.int64)  # converted once, not per size
    for d in table.sizes:
        # A size's floor: its groups perfectly balanced (its samples' table times spread evenly,
        # or its longest sample alone) plus the sync.
        times = table.time_s[:, table.size_index(d)].take(class_of)
        floors.append((max(float(times.max()), float(times.sum()) / (num_gpus // d)) + table.grad_sync_s, d))
    best: tuple[float, int, Draft] | None = None  # (step time, size, draft)
    # Most promising size first, so that the others are skipped by their floors: a size whose
    # floor is over the best draft so far (with a 10% margin for placements slower than the
    # table's aligned one) cannot beat it, in any order.
    for floor_s, d in sorted(floors):
        if best is not None and floor_s > 1.1 * best[0]:
            continue
        draft = lpt_draft(table, group_size=d)
        if draft is None:
            continue
        t = draft_step_time_s(draft, arrays, table.cost_model, grad_sync_s=table.grad_sync_s)
        if best is None or t < best[0] or (t == best[0] and d < best[1]):  # ties: the smaller size
            best = (t, d, draft)
    return None if best is None else best[2]
