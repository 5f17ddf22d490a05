"""The work limits that keep the 50 ms preset near its budget: the pattern enumerations shared
through a ``PatternMemo``, the partition LP's bisection tolerance (``lp_bound_rel_tol``) and the
cover search skipped near a bound (``cover_min_gap``). Each saves work only: bounds stay below
the brute-force optimum and below the bound of the full work, and a skipped cover is one that
could not have made the plan faster."""

from __future__ import annotations

import math

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.bounds.lp import partition_lp_bound
from planner.bounds.patterns import PatternMemo, cover_patterns, pattern_bound
from planner.config import PlannerConfig
from planner.planning import plan_batch_with_stats, prepare
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch
from tests.planner.bruteforce import optimum_step_time_s
from tests.planner.tiny import samples_of, tiny_cluster, tiny_cost_model

CASES = [([2400, 1300, 1250, 1200, 120, 90], 4, 2), ([1500, 1400, 1300, 300, 200], 4, 2),
         ([1100, 1000, 900, 300, 250, 200, 150], 4, 2)]


@pytest.mark.parametrize(("tokens", "num_gpus", "per_node"), CASES)
def test_a_memo_changes_no_pattern_bound_and_enumerates_each_deadline_once(tokens: list[int], num_gpus: int,
                                                                        per_node: int) -> None:
    cmf = tiny_cost_model()
    cluster = tiny_cluster(num_gpus=num_gpus, gpus_per_node=per_node)
    cm = CostModel(file=cmf, cluster=cluster)
    samples = samples_of(tokens, prefix="memo-")
    config = PlannerConfig(use_cpsat=False, memory_safety_fraction=0.0)
    prep = prepare(samples, cluster=cluster, cost_model=cmf, config=config)
    lower = prep.bounds.compute_makespan_s
    alone = pattern_bound(prep.table, lower_s=lower, iterations=12)
    memo = PatternMemo()
    shared = pattern_bound(prep.table, lower_s=lower, iterations=12, memo=memo)
    assert shared == alone
    assert memo.bound_s == shared and memo.given_up_s == math.inf and memo.found
    deadlines = set(memo.found)
    assert pattern_bound(prep.table, lower_s=lower, iterations=12, memo=memo) == shared
    assert set(memo.found) == deadlines  # the second bisection enumerated nothing new
    best = optimum_step_time_s(samples, cm, [d for d in cm.allowed_group_sizes() if d & (d - 1) == 0])
    assert lower <= shared <= (best - prep.table.grad_sync_s) * (1 + 1e-9)


def test_a_memo_gives_up_at_once_above_a_deadline_that_gave_up() -> None:
    cmf = tiny_cost_model()
    cluster = tiny_cluster(num_gpus=4, gpus_per_node=2)
    prep = prepare(samples_of([1100, 1000, 900, 300, 250, 200, 150], prefix="up-"), cluster=cluster,
                   cost_model=cmf, config=PlannerConfig(use_cpsat=False))
    deadline = prep.bounds.compute_makespan_s * 1.2
    assert cover_patterns(prep.table, deadline * 1.5, max_visits=10**6) is not None  # enumerable alone
    memo = PatternMemo()
    assert cover_patterns(prep.table, deadline, max_visits=1, memo=memo) is None
    assert memo.given_up_s == deadline
    assert cover_patterns(prep.table, deadline * 1.5, max_visits=10**6, memo=memo) is None
    # a bound from such a memo only stays lower: what was proven before giving up stands
    assert pattern_bound(prep.table, lower_s=prep.bounds.compute_makespan_s, iterations=8, memo=memo) <= \
        pattern_bound(prep.table, lower_s=prep.bounds.compute_makespan_s, iterations=8)


@pytest.mark.parametrize("step", [0, 1])
def test_the_lp_bisection_tolerance_gives_a_prefix_of_the_full_bisection(step: int) -> None:
    """The bisection with a tolerance takes the same midpoints as the full one until it stops, so its
    bound is at most the full one's and within the tolerance of the threshold (video-short 64 x h200x32,
    where the LP raises the bound over several bisection steps)."""
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=64, seed=0, step=step)
    prep = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig())
    table, lower = prep.table.for_bounds(), prep.bounds.compute_makespan_s
    kwargs = dict(lower_s=lower, iterations=8, micro_batch_buckets=1, max_classes=64)
    full = partition_lp_bound(table, **kwargs)  # type: ignore[arg-type]
    tol = 0.005
    early = partition_lp_bound(table, rel_tol=tol, **kwargs)  # type: ignore[arg-type]
    assert full > lower * 1.001  # the LP binds here, so the tolerance has something to cut
    assert full * (1 - tol) * (1 - 1e-9) <= early <= full


def test_the_cover_is_skipped_only_where_it_cannot_gain_more_than_the_tolerance() -> None:
    """text-longtail, 16 samples on h200x32 (step 0): the search's plan is 0.34% over the simple bounds,
    so the default preset skips the cover search (1% tolerance); with the tolerance off the cover runs
    and the plan is the same."""
    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=16, seed=0, step=0)
    plans = {}
    for gap in (0.01, 0.0):
        plan, stats = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf,
                                            config=PlannerConfig(cover_min_gap=gap), reference_sample=spec.max_sample)
        assert validate_plan(plan, samples, cost_model=CostModel(file=cmf, cluster=cluster)) == []
        assert (stats.cover_step_time_s is None) == (gap > 0)
        plans[gap] = plan
    skipped, full = plans[0.01], plans[0.0]
    assert skipped.predicted_step_time_s <= full.predicted_step_time_s * (1 + 0.01)
    assert skipped.predicted_step_time_s <= skipped.lower_bound.value_s * (1 + 0.01)
