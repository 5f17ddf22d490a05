"""The partition LP on merged sample classes: the LP of a batch of many distinct lengths at the
cost of one of a few.

A batch of text samples has about as many classes as samples, and the partition LP's cost grows
with them (``planner.bounds.lp``: 0.05-0.1 s a solve at 256 classes), so the small presets left
such batches to the simple bounds. Merging the classes into at most ``k`` buckets, each bucket
charged per size the *least* of its members' coefficients (time, byte-priced times, bytes), keeps
the LP a relaxation of every plan: a plan's solution of the full LP, summed over each bucket's
members, solves the merged one (every row's coefficients only fell, a member allowed by the
deadline leaves its bucket allowed, and fewer samples count as long in constraint 5). So its
infeasibility still proves a deadline out of reach, with a bound at most the full LP's.

Buckets are runs of classes in the order of their least GPU-seconds over the sizes (similar
samples together), each spanning the same ratio of them (equal steps of its logarithm).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from planner.bounds.lp import LPInputs
from planner.costs import CostTable


@dataclass(frozen=True, slots=True)
class MergedClasses:
    """What the LP reads of a table's classes: each bucket's sample indices."""

    members: list[list[int]]

    @property
    def num_classes(self) -> int:
        """Buckets."""
        return len(self.members)


def merge_buckets(table: CostTable, max_classes: int) -> list[list[int]]:
    """Runs of the table's classes (indices), at most ``max_classes`` of them, in the order of each
    class's least GPU-seconds over the sizes, each spanning an equal step of their logarithm.

    Raises:
        ValueError: for ``max_classes`` below 1.
    """
    if max_classes < 1:
        raise ValueError(f"max_classes must be at least 1, got {max_classes}")
    num_c = table.classes.num_classes
    if num_c <= max_classes:
        return [[c] for c in range(num_c)]
    sizes = np.asarray(table.sizes, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        area = np.where(np.isfinite(table.time_s), table.time_s * sizes[None, :], np.inf).min(axis=1)
    order = np.lexsort((np.arange(num_c), area))
    finite = np.isfinite(area[order])
    low, high = np.log(area[order][finite].min()), np.log(area[order][finite].max())
    # equal steps in log GPU-seconds: a bucket spans a fixed ratio, so the long tail keeps its
    # resolution (equal sample counts put the few longest with many shorter ones)
    step = (high - low) / max_classes if high > low else 1.0
    key = np.where(finite, np.minimum(((np.log(np.where(finite, area[order], 1.0)) - low) / step).astype(np.int64),
                                      max_classes - 1), max_classes - 1)
    return [order[key == b].tolist() for b in range(max_classes) if (key == b).any()]


def merged_problem(table: CostTable, inputs: LPInputs, max_classes: int) -> tuple[CostTable, LPInputs]:
    """The table and LP inputs with classes merged into at most ``max_classes`` buckets (each
    coefficient the least over a bucket's members); the same pair when it has no more classes."""
    buckets = merge_buckets(table, max_classes)
    if len(buckets) == table.classes.num_classes:
        return table, inputs

    def least(values: np.ndarray, axis: int) -> np.ndarray:
        return np.stack([np.min(np.take(values, b, axis=axis), axis=axis) for b in buckets], axis=axis)

    view = copy.copy(table)
    view.time_s = least(table.time_s, 0)
    view.classes = MergedClasses(members=[[i for c in b for i in table.classes.members[c]] for b in buckets])  # type: ignore[assignment]
    merged = LPInputs(overhead_s=inputs.overhead_s, prices_per_byte=inputs.prices_per_byte,
                      priced_s=tuple(least(u, 1) if u.shape[1] else u for u in inputs.priced_s),
                      least_bytes=least(inputs.least_bytes, 0), budget_bytes=inputs.budget_bytes)
    return view, merged
