"""The partition LP on merged sample classes: the LP of a batch of many distinct lengths at the
cost of one of a few.

A batch of text samples has about as many classes as samples, and the partition LP's cost grows
with them (``planner.bounds.lp``: 0.05-0.1 s a solve at 256 classes), so the small presets left
such batches to the simple bounds. The classes are merged into at most ``k`` buckets, and a
bucket's variable counts *work*, not samples: each class ``c`` has a unit ``w_c > 0`` (its least
GPU-seconds over the sizes), a bucket ``B`` the unit ``w_B = min_c w_c`` over its members, and
``x_B = sum_c w_c x_c / w_B`` (so ``sum x_B = sum_c n_c w_c / w_B``, the bucket's count). Every
coefficient ``e_c`` of a row (time, byte-priced time, bytes, as the full LP reads them) becomes
``e_B = w_B * min_c (e_c / w_c)``, so ``e_B x_B <= sum_c e_c x_c``: a plan's solution of the full
LP, summed this way over each bucket's members, solves the merged one (every row's left side
only fell; a member allowed by the deadline leaves its bucket allowed, since ``e_B <= e_c``;
constraint 5 counts ``x_B * w_B / max_c w_c`` samples, at most the bucket's long samples
there, and a bucket is long only where its every member is). So its infeasibility still proves
a deadline out of reach, with a bound at most the full LP's. Charging each bucket the least
coefficient *per unit of work* loses only how much the members' costs differ in shape across
sizes; charging the least coefficient per sample (the members' smallest) lost their spread in
length too: on 5 steps of text-longtail @ gpt-oss-120b, 256 samples on h200x64, 64 buckets
per sample were 1.0-1.5% of the step time under the whole LP's bound.

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


def work_units(table: CostTable) -> np.ndarray:
    """``w_c``: each class's least GPU-seconds over the sizes (1 where it has none finite and
    positive: any positive unit keeps the merged LP a relaxation)."""
    sizes = np.asarray(table.sizes, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        area = np.where(np.isfinite(table.time_s), table.time_s * sizes[None, :], np.inf).min(axis=1)
    return np.where(np.isfinite(area) & (area > 0), area, 1.0)


def merged_problem(table: CostTable, inputs: LPInputs, max_classes: int) -> tuple[CostTable, LPInputs]:
    """The table and LP inputs with classes merged into at most ``max_classes`` buckets counted in
    work units (the module docstring); the same pair when it has no more classes."""
    buckets = merge_buckets(table, max_classes)
    if len(buckets) == table.classes.num_classes:
        return table, inputs
    unit = work_units(table)
    unit_b = np.array([unit[b].min() for b in buckets])

    def least(values: np.ndarray, axis: int) -> np.ndarray:
        """Per bucket, ``w_B * min_c (e_c / w_c)`` along ``axis`` (classes)."""
        shape = [1] * values.ndim
        shape[axis] = -1
        per_unit = values / unit.reshape(shape)
        shape[axis] = len(buckets)
        return np.stack([np.min(np.take(per_unit, b, axis=axis), axis=axis) for b in buckets],
                        axis=axis) * unit_b.reshape(shape)

    time_s = table.time_s
    view = copy.copy(table)
    view.time_s = least(time_s, 0)
    view.classes = MergedClasses(members=[[i for c in b for i in table.classes.members[c]] for b in buckets])  # type: ignore[assignment]
    # The coefficients the full LP reads: a byte-priced time where some policy fits alone (else the
    # time), the least bytes where some fit (else 0).
    priced = tuple(least(np.where(np.isfinite(u), u, time_s.T[j][None, :]), 1) if u.shape[1] else u
                   for j, u in enumerate(inputs.priced_s))
    least_bytes = least(np.where(np.isfinite(inputs.least_bytes), inputs.least_bytes, 0.0), 0)
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    merged = LPInputs(overhead_s=inputs.overhead_s, prices_per_byte=inputs.prices_per_byte,
                      priced_s=priced, least_bytes=least_bytes, budget_bytes=inputs.budget_bytes,
                      counts=np.array([(counts[b] * unit[b]).sum() for b in buckets]) / unit_b,
                      samples_per_unit=unit_b / np.array([unit[b].max() for b in buckets]))
    return view, merged
