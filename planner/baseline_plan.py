"""A baseline's whole plan for a batch, rebuilt: what ``Plan.baselines_s`` only records as a time.

``plan_batch`` computes every baseline's draft and keeps only its step time. A report that
shows how a baseline runs the same step rebuilds the draft from the same inputs (the batch,
the cluster, the cost model and the planner options with the plan's seed) and assembles it
with the same cost model, so its step time is the recorded one (checked by the caller through
:func:`rebuilt_matches`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from costmodel.evaluate import CostModel
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.assemble import BatchArrays, PlanMeta, assemble_plan
from planner.baselines import REGISTRY, baseline_drafts, strongest, with_layouts
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.layouts import layout_options
from planner.plan import LowerBound, Plan

REL_TOL = 1e-6
"""Relative tolerance between a rebuilt baseline's step time and the recorded one."""


def baseline_plan(samples: Sequence[Sample], *, name: str, cluster: ClusterSpec,
                  cost_model: CostModelFile, config: PlannerConfig, step: int | None = None,
                  reference_sample: Sample | None = None) -> Plan:
    """The plan the baseline ``name`` makes for the batch.

    Args:
        samples: The batch, in the order the planner saw it.
        name: A baseline of ``planner.baselines`` (``bucket-sp{d}`` for any ``d``).
        cluster: The world.
        cost_model: The cost-model file.
        config: The planner options the step was planned with (seed included).
        step: Step index recorded in the plan.
        reference_sample: The workload's longest sample, when the plan was made with one.

    Raises:
        ValueError: for an unknown baseline, or one that cannot hold the batch.
    """
    is_bucket = name.startswith("bucket-sp") and name.removeprefix("bucket-sp").isdigit()
    if name not in REGISTRY and not is_bucket:
        raise ValueError(f"unknown baseline {name!r}; known: {sorted(REGISTRY)} or bucket-sp<D>")
    cm = CostModel(file=cost_model, cluster=cluster)
    options = layout_options(cm, layout=config.layout, mode=config.sizes, max_group_size=config.max_group_size,
                             explicit=config.group_sizes)
    table = CostTable(cm, samples, sizes=list(options), memory_safety_fraction=config.memory_safety_fraction,
                      ring_options=options)
    extra = [int(name.removeprefix("bucket-sp"))] if is_bucket and name not in REGISTRY else []
    drafts = baseline_drafts(table, seed=config.seed, reference=reference_sample,
                             extra_bucket_sizes=extra)
    if name not in drafts:
        raise ValueError(f"baseline {name!r} cannot hold this batch (a sample does not fit its rule)")
    meta = PlanMeta(status="BASELINE", method=name, wall_time_s=0.0,
                    lower_bound=LowerBound(value_s=0.0, kind="none"), seed=config.seed, step=step,
                    loss_normalization=config.loss_normalization)
    return assemble_plan(with_layouts(name, drafts[name], table), samples, cost_model=cm, meta=meta,
                         arrays=BatchArrays.of(samples))


def strongest_baseline_plan(plan: Plan, samples: Sequence[Sample], *, cluster: ClusterSpec,
                            cost_model: CostModelFile, config: PlannerConfig,
                            reference_sample: Sample | None = None) -> Plan | None:
    """The plan of the plan's strongest baseline (the fastest but ``naive``), or None when it
    recorded none.

    Raises:
        ValueError: see :func:`baseline_plan`.
    """
    best = strongest(plan.baselines_s)
    if best is None:
        return None
    return baseline_plan(samples, name=best[0], cluster=cluster, cost_model=cost_model,
                         config=config, step=plan.step, reference_sample=reference_sample)


def rebuilt_matches(plan: Plan, baseline: Plan) -> bool:
    """True when the rebuilt baseline's step time is the one ``plan.baselines_s`` records."""
    recorded = plan.baselines_s.get(baseline.solver.method)
    return recorded is not None and math.isclose(baseline.predicted_step_time_s, recorded,
                                                  rel_tol=REL_TOL)
