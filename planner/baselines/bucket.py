"""``bucket-sp{d}``: bucket parallel, the baseline published with DCP.

One fixed SP size ``d`` for the whole run (the paper's 4; 1, 2 and 8 are reported too, and
the reports pick the best per workload): ``N // d`` groups (ranks left over stay idle).
Samples are grouped by shape bucket (``common.shape_buckets``); each bucket is cut, in
sampler order, into batches of the largest size that fits memory under full checkpointing
(sized on the bucket's largest sample); the batches are dealt round-robin to the groups, bucket
by bucket, and each runs as one micro-batch. A size on which the workload's longest sample does not fit is no valid
run setting and is left out. Every sample is checkpointed fully, as
``L - 1`` recomputed layers (``common.full_checkpoint_layers``: ``L`` is dominated by ``L - 1``
under the cost model, so the baseline gets the cheaper of the two).
"""

from __future__ import annotations

import math

import numpy as np

from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.common import fixed_layout, full_checkpoint_layers, shape_buckets
from planner.costs import CostTable


def bucket_batch_size(table: CostTable, members: list[int], *, group_size: int) -> int:
    """Largest number of samples of a bucket that fit one micro-batch of ``group_size`` ranks
    under full checkpointing (0 when its largest sample does not fit alone)."""
    return bucket_batch_sizes(table, [members], group_size=group_size)[0]


def bucket_batch_sizes(table: CostTable, buckets: list[list[int]], *, group_size: int
                       ) -> list[int]:
    """``bucket_batch_size`` of every bucket, with one cost-model evaluation."""
    cm = table.cost_model
    # Tokens of every sample through its class (its shape), as floats: one gather instead of
    # reading each sample's pydantic field (0.07 -> 0.01 s a call at 131,072 samples).
    tokens = table.classes.tokens[table.classes.class_of].tolist()
    largest = [max(map(tokens.__getitem__, members)) for members in buckets]
    per_sample = np.asarray(cm.activation_bytes(
        np.asarray(largest, dtype=np.float64), group_size=group_size,
        recompute_layers=full_checkpoint_layers(cm.num_layers), layout=table.layout_of(group_size)),
        dtype=np.float64).tolist()
    return [max(0, math.floor(table.budget_bytes / b)) for b in per_sample]


def bucket_draft(table: CostTable, *, group_size: int, seed: int = 0,
                 reference: Sample | None = None) -> Draft | None:
    """The bucket-parallel draft at a fixed SP size.

    Args:
        table: The batch's cost table.
        group_size: The fixed SP size ``d``.
        seed: Unused (the baseline is deterministic); the registry's signature.
        reference: The workload's longest sample: a size fixed for the whole run must hold it
            (default: the batch's samples only).

    Returns:
        The draft, or None when ``d`` is not allowed or a sample (or the reference) does not
        fit ``d`` ranks even with full checkpointing.
    """
    del seed
    cm = table.cost_model
    groups = fixed_layout(table, group_size)
    if groups is None:
        return None
    if reference is not None and float(cm.activation_bytes(
            reference.tokens, group_size=group_size, recompute_layers=full_checkpoint_layers(cm.num_layers),
            layout=table.layout_of(group_size))) > table.budget_bytes:
        return None
    num_work = table.cost_model.cluster.num_gpus // group_size
    k_full = full_checkpoint_layers(table.cost_model.num_layers)
    turn = 0
    buckets = shape_buckets(table)
    for members, batch in zip(buckets, bucket_batch_sizes(table, buckets, group_size=group_size),
                              strict=True):
        if batch == 0:
            return None
        for start in range(0, len(members), batch):
            chunk = members[start:start + batch]
            groups[turn % num_work].micro_batches.append([(i, k_full) for i in chunk])
            turn += 1
    return groups
