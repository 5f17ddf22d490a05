"""``prepare``: a batch checked and tabulated for the planner, before any search.

It refuses what no plan can hold (an empty batch, repeated ids, a 1D sample for a 2D model, a
world the allowed sizes cannot partition, model states over the memory cap, a sample that fits
no group), then builds the cost table per sample class and allowed size (``planner.costs``),
the simple lower bounds on the bounds' view of that table (``planner.bounds.simple``) and the
per-class arrays the searches read (``planner.assemble.BatchArrays``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.evaluate import CostModel
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from costmodel.units import fmt_bytes
from planner.assemble import BatchArrays
from planner.bounds.simple import BoundReport, lower_bounds
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.layouts import layout_options
from planner.placement import representable


class SampleFitsNowhereError(ValueError):
    """A sample of the batch fits on no allowed group, even with full checkpointing: no plan of
    this batch exists on this cluster under this cost model. A ``ValueError`` like the other
    refusals of bad input; its own type lets a caller that plans many batches (a benchmark's grid)
    record this refusal and go on while any other error still stops it."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked batch with its cost table and bounds."""

    cost_model: CostModel
    table: CostTable
    bounds: BoundReport
    arrays: BatchArrays

def prepare(samples: Sequence[Sample], *, cluster: ClusterSpec, cost_model: CostModelFile,
            config: PlannerConfig) -> Prepared:
    """Check the input and tabulate costs and bounds.

    Raises:
        ValueError: for an empty batch, repeated sample ids, a 1D sample for a 2D model, a world
            the allowed sizes cannot partition, or model states over the memory cap.
        SampleFitsNowhereError: (a ``ValueError``) for a sample that fits nowhere, named with
            its tokens, the activation memory it needs on the largest allowed group and the limit.
    """
    if len(samples) == 0:
        raise ValueError("the batch is empty: a plan needs at least one sample")
    seen: set[str] = set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"sample id {s.id!r} appears more than once in the batch")
        seen.add(s.id)
    cm = CostModel(file=cost_model, cluster=cluster)
    if cm.is_2d:
        flat = next((s for s in samples if not s.is_2d), None)
        if flat is not None:
            raise ValueError(f"sample {flat.id!r} has tokens but no frames, height and width: "
                             f"model {cost_model.model.name!r} is 2D (spatial + temporal attention)")
    options = layout_options(cm, layout=config.layout, mode=config.sizes, max_group_size=config.max_group_size,
                             explicit=config.group_sizes)
    sizes = list(options)
    n = cluster.num_gpus
    if not sizes or not representable(n, sizes):
        raise ValueError(f"the world of {n} ranks cannot be partitioned into groups of the "
                         f"allowed sizes {sizes} (layout={config.layout!r}, num_heads={cost_model.model.num_heads}, "
                         f"kv_heads={cost_model.model.kv_heads}: a Ulysses degree divides the query heads and "
                         "divides the key/value heads or is a multiple of them; "
                         f"max_group_size={config.max_group_size})")
    budget = cm.activation_budget_bytes()
    if budget <= 0:
        raise ValueError(f"model states and working buffers need {fmt_bytes(cm.fixed_bytes())} per "
                         f"rank, over the memory cap {fmt_bytes(cluster.memory_cap_bytes)}")
    table = CostTable(cm, samples, sizes=sizes, memory_safety_fraction=config.memory_safety_fraction,
                      intra_policies=config.intra_policies and config.intra_search, ring_options=options)
    if not table.fits_anywhere.all():
        c = int((~table.fits_anywhere).nonzero()[0][0])
        sample = samples[table.classes.members[c][0]]
        biggest = max(sizes)
        act = float(cm.activation_bytes(sample.tokens, group_size=biggest,
                                        recompute_layers=cm.num_layers))
        raise SampleFitsNowhereError(
            f"sample {sample.id!r} ({sample.tokens:,} tokens) fits nowhere: even on the largest "
            f"allowed group ({biggest} ranks) with full checkpointing it needs {fmt_bytes(act)} "
            f"of activations per rank, over the limit of {fmt_bytes(table.budget_bytes)} "
            f"(memory cap {fmt_bytes(cluster.memory_cap_bytes)} minus {fmt_bytes(cm.fixed_bytes())} fixed)")
    return Prepared(cost_model=cm, table=table, bounds=lower_bounds(table.for_bounds()),
                    arrays=BatchArrays.of_classes(table.classes))
