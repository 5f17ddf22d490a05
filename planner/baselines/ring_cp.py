"""``ring-cp``: Megatron-Core's ring context parallelism at one CP size for the whole run.

The CP size is the smallest divisor of the world on which the workload's longest sample fits
(``fixed_cp.cp_size``); every replica is one ring of that many ranks (Ulysses degree 1); samples
are balanced over the ``N / d`` data-parallel replicas by tokens (``fixed_cp.fixed_cp_draft``).
"""

from __future__ import annotations

from costmodel.evaluate import CostModel
from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.fixed_cp import fixed_cp_draft
from planner.costs import CostTable


def ring_layout(cost_model: CostModel, size: int) -> int:
    """Ring degree at CP size ``size``: the whole group is one ring (``u = 1``, ``r = size``)."""
    del cost_model
    return size


def ring_cp_draft(table: CostTable, *, seed: int = 0, reference: Sample | None = None) -> Draft | None:
    """The fixed ring-CP draft (None when the layout cannot hold the batch).

    Args:
        table: The batch's cost table.
        seed: Unused (the baseline is deterministic); the registry's signature.
        reference: The workload's longest sample (fixes the CP size); None: the batch's longest.
    """
    del seed
    return fixed_cp_draft(table, rule=ring_layout, reference=reference)
