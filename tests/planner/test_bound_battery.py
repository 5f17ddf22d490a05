"""A battery of lower-bound checks over many batches and presets (property-based, hypothesis).

Each drawn batch is planned with the partition LP on and wrong bounds *dropped* rather than raised
(``strict_bounds=False``, as the service runs), so a broken bound is caught here by several
assertions that do not share its code, not only by the planner's own run-time check:

* nothing was dropped (the run-time check found no wrong bound);
* the reported bound is strictly below the plan's step time (no solver proved these plans
  optimal: CP-SAT is off), and ``cpsat-optimal`` never appears;
* it is at most the step time of every baseline and of a second plan made with other settings;
* the partition LP (on the bounds' view: rings too) is feasible at the plan's own compute
  makespan (the plan is a solution of it): an LP wrongly infeasible everywhere fails this,
  whatever the bisection does with it;
* the LP bound recomputed from the table is finite, at least the simple bound it starts from,
  below the plan, the same on a second call (work limits, no clock), and proven: one of the LP's
  two problems (one micro-batch bucket, then the finer one) is infeasible just below it;
* the pattern bound (batches of at most 32): the plan's own groups are a cover at its compute
  makespan, and the bound is below the plan, reproducible and proven infeasible just below.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.planning import plan_batch, plan_batch_with_stats, prepare
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch

WORKLOADS = ("video-short", "video-balanced", "video-long", "video3d-wan", "text-longtail", "text-longcontext")
CLUSTERS = ("h200x8", "h200x32")
LP_ITERATIONS = 4
CONFIG = PlannerConfig(use_cpsat=False, lp_bound_iterations=LP_ITERATIONS, lp_bound_min_gap=0.0,
                       strict_bounds=False)
OTHER = PlannerConfig(use_cpsat=False, seed=7, num_lpt_runs=12, local_search_max_moves=80, compute_baselines=False)


def _batch(workload: str, cluster_name: str, num_samples: int, seed: int):  # type: ignore[no-untyped-def]
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    return spec, cluster, cmf, sample_batch(spec, num_samples=num_samples, seed=seed, step=0)


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workload=st.sampled_from(WORKLOADS), cluster_name=st.sampled_from(CLUSTERS),
       num_samples=st.integers(min_value=4, max_value=96), seed=st.integers(min_value=0, max_value=10_000))
def test_every_bound_holds_on_many_batches(workload: str, cluster_name: str, num_samples: int, seed: int) -> None:
    from planner.bounds.lp import LPInputs, lp_feasible, partition_lp_bound

    spec, cluster, cmf, samples = _batch(workload, cluster_name, num_samples, seed)
    try:
        prep = prepare(samples, cluster=cluster, cost_model=cmf, config=CONFIG)
    except ValueError:  # a drawn sample fits nowhere on this cluster: no plan to bound
        return
    plan, stats = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf, config=CONFIG,
                                        reference_sample=spec.max_sample)
    bound, step_s = plan.lower_bound.value_s, plan.predicted_step_time_s
    where = (workload, cluster_name, num_samples, seed, plan.lower_bound, step_s)
    # 1. The planner's own run-time check dropped nothing, and the validator finds nothing.
    assert stats.dropped_bounds == (), where
    assert validate_plan(plan, samples, cost_model=CostModel(file=cmf, cluster=cluster)) == [], where
    # 2. Strictly below a plan nothing proved optimal; no claimed proof.
    assert plan.solver.status != "OPTIMAL" and plan.lower_bound.kind != "cpsat-optimal", where
    assert bound < step_s * (1 - 1e-9) and plan.gap > 0, where
    # 3. Below every other plan: the baselines and a plan made with other settings.
    for name, baseline_s in plan.baselines_s.items():
        assert bound <= baseline_s * (1 + 1e-9), (name, baseline_s, where)
    other = plan_batch(samples, cluster=cluster, cost_model=cmf, config=OTHER, reference_sample=spec.max_sample)
    assert bound <= other.predicted_step_time_s * (1 + 1e-9), (other.predicted_step_time_s, where)
    table, sync = prep.table, prep.table.grad_sync_s
    if num_samples <= CONFIG.pattern_bound_max_samples:  # 4b. the pattern bound (rings too: the bounds' view)
        from planner.bounds.patterns import cover_feasible, pattern_bound

        view, compute_s = table.for_bounds(), step_s - sync
        assert cover_feasible(view, compute_s * (1 + 1e-9)) is not False, where
        simple_s = prep.bounds.compute_makespan_s
        pattern_s = pattern_bound(view, lower_s=simple_s, iterations=4)
        assert simple_s <= pattern_s < compute_s * (1 - 1e-9), (pattern_s, where)
        assert pattern_bound(view, lower_s=simple_s, iterations=4) == pattern_s, where
        if pattern_s > simple_s * (1 + 1e-6):
            assert cover_feasible(view, pattern_s * (1 - 1e-6)) is False, (pattern_s, where)
    # 4. The plan is a solution of the partition LP (and of the whole-group MIP), on the bounds'
    # view of the table (with rings the table's own times bound a sample's share from above).
    view, compute_s = table.for_bounds(), step_s - sync
    assert lp_feasible(view, compute_s * (1 + 1e-9)), where
    assert lp_feasible(view, compute_s * (1 + 1e-9), integral_groups=True, micro_batch_buckets=2), where
    # 5. The LP bound itself: finite, from the simple bound up, below the plan, reproducible, proven;
    # on classes merged into 8 buckets too (a relaxation: proven there, proven on the full LP).
    simple_s = prep.bounds.compute_makespan_s
    inputs = LPInputs.of(view)
    for merge in (None, 8):
        lp_s = partition_lp_bound(view, lower_s=simple_s, iterations=LP_ITERATIONS, max_classes=merge)
        assert math.isfinite(lp_s) and simple_s <= lp_s < compute_s * (1 - 1e-9), (merge, lp_s, simple_s, where)
        assert partition_lp_bound(view, lower_s=simple_s, iterations=LP_ITERATIONS, max_classes=merge) == lp_s, where
        if lp_s > simple_s * (1 + 1e-6):  # raised by the LP: one of its two problems is infeasible there
            below_s = lp_s * (1 - 1e-6)
            assert not (lp_feasible(view, below_s, inputs=inputs, micro_batch_buckets=1)
                        and lp_feasible(view, below_s, inputs=inputs)), (merge, lp_s, where)
