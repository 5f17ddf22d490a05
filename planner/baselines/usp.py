"""``usp``: a USP hybrid (Fang and Zhao 2024) at one size and one Ulysses x ring split for the run.

The CP size is the smallest divisor of the world on which the workload's longest sample fits
(``fixed_cp.cp_size``); the Ulysses degree ``u`` is the largest the heads allow
(``ModelSpec.allowed_group_sizes``) that divides both the size and a node, so that the all-to-alls
stay on NVLink, as USP recommends; the ring degree is ``r = size / u``. Samples are balanced over
the ``N / d`` data-parallel replicas by tokens (``fixed_cp.fixed_cp_draft``).
"""

from __future__ import annotations

from costmodel.evaluate import CostModel
from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.fixed_cp import fixed_cp_draft
from planner.costs import CostTable


def usp_layout(cost_model: CostModel, size: int) -> int:
    """Ring degree at CP size ``size``: ``size / u``, ``u`` the largest degree the heads allow that
    divides ``size`` and the node."""
    gpn = cost_model.cluster.gpus_per_node
    u = max(x for x in cost_model.allowed_group_sizes(max_size=min(size, gpn)) if size % x == 0 and gpn % x == 0)
    return size // u


def usp_draft(table: CostTable, *, seed: int = 0, reference: Sample | None = None) -> Draft | None:
    """The fixed USP draft (None when the layout cannot hold the batch).

    Args:
        table: The batch's cost table.
        seed: Unused (the baseline is deterministic); the registry's signature.
        reference: The workload's longest sample (fixes the CP size); None: the batch's longest.
    """
    del seed
    return fixed_cp_draft(table, rule=usp_layout, reference=reference)
