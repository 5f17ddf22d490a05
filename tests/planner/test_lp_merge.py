"""The partition LP on merged sample classes (``planner.bounds.lp_merge``) stays a relaxation: the
plan solves it, and where it proves a deadline infeasible the full LP does too."""

from __future__ import annotations

import pytest

from costmodel.presets import default_cost_model_file, load_cluster
from planner.bounds.lp import LPInputs, lp_feasible, partition_lp_bound
from planner.bounds.lp_merge import merge_buckets, merged_problem
from planner.config import PlannerConfig
from planner.planning import plan_batch, prepare
from planner.workload import WorkloadSpec, sample_batch

CASES = [("text-longtail", "gpt-oss-20b", "h200x64", 256, 8), ("text-longcontext", "llama-3.1-8b", "h200x32", 96, 1),
         ("text-longtail", "llama-3.1-8b", "h200x32", 200, 1)]


@pytest.mark.parametrize(("workload", "model", "cluster_name", "num_samples", "experts"), CASES,
                         ids=[f"{w}@{m}-{n}" for w, m, _, n, _ in CASES])
def test_merged_lp_is_a_relaxation(workload: str, model: str, cluster_name: str, num_samples: int,
                                   experts: int) -> None:
    spec = WorkloadSpec.preset(workload).model_copy(update={"model": model})
    cluster = load_cluster(cluster_name, **({"expert_parallel_size": experts} if experts > 1 else {}))
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=num_samples, seed=3, step=1)
    config = PlannerConfig(use_cpsat=False, lp_bound_iterations=0, pattern_bound_iterations=0)
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=config).table
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config)
    compute_s = plan.predicted_step_time_s - table.grad_sync_s
    buckets = merge_buckets(table, 16)
    assert len(buckets) <= 16 < table.classes.num_classes
    assert sorted(c for b in buckets for c in b) == list(range(table.classes.num_classes))
    inputs = LPInputs.of(table)
    view, merged = merged_problem(table, inputs, 16)
    assert view.classes.num_classes == len(buckets) and sum(len(m) for m in view.classes.members) == num_samples
    # the plan's groups solve the merged LP at its own makespan
    assert lp_feasible(view, compute_s * (1 + 1e-9), inputs=merged)
    lower = compute_s * 0.5
    bound = partition_lp_bound(table, lower_s=lower, iterations=12, max_classes=16)
    assert lower <= bound < compute_s, (bound, compute_s)
    if bound > lower * (1 + 1e-6):  # proven: the full LP is infeasible just below it too
        assert not lp_feasible(table, bound * (1 - 1e-6), inputs=inputs, micro_batch_buckets=1) or \
            not lp_feasible(table, bound * (1 - 1e-6), inputs=inputs)
    full = partition_lp_bound(table, lower_s=lower, iterations=12)
    assert bound <= full * (1 + 0.02), (bound, full)  # looser, up to the bisection's resolution


def test_merge_buckets_refuses_no_bucket() -> None:
    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster("h200x8")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    table = prepare(sample_batch(spec, num_samples=20, seed=0, step=0), cluster=cluster, cost_model=cmf,
                    config=PlannerConfig()).table
    with pytest.raises(ValueError, match="max_classes"):
        merge_buckets(table, 0)
    assert merge_buckets(table, 10_000) == [[c] for c in range(table.classes.num_classes)]


def test_merged_lp_is_feasible_wherever_the_full_lp_is() -> None:
    """The work-unit merge on a long tail (gpt-oss-120b, one 78k-token sample among 256): at every
    deadline the full LP (one micro-batch bucket and three; the whole-group MIP) is feasible at, the
    merged one is too; and the merged bound is within 0.5% of the full one (per-sample least
    coefficients were 1-1.5% of the step time under it there). (One micro-batch bucket: with three,
    HiGHS ends some of the full LP's solves with an unknown status, which ``lp_feasible`` reads as
    feasible.)"""
    spec = WorkloadSpec.preset("text-longtail").model_copy(update={"model": "gpt-oss-120b"})
    cluster = load_cluster("h200x64", expert_parallel_size=8)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=256, seed=0, step=1)
    prep = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig())
    table = prep.table.for_bounds()
    inputs = LPInputs.of(table)
    view, merged = merged_problem(table, inputs, 32)
    assert view.classes.num_classes <= 32 < table.classes.num_classes
    assert merged.counts is not None and merged.samples_per_unit is not None
    assert (merged.samples_per_unit > 0).all() and (merged.samples_per_unit <= 1).all()
    lower = prep.bounds.compute_makespan_s
    full = partition_lp_bound(table, lower_s=lower, iterations=8, micro_batch_buckets=1)
    assert full > lower * 1.01  # the LP binds here
    feasible_full = 0
    for factor in (0.97, 0.99, 0.999, 1.001, 1.005, 1.01, 1.02, 1.05):
        deadline = full * factor
        if lp_feasible(table, deadline, inputs=inputs, micro_batch_buckets=1):
            feasible_full += 1
            assert lp_feasible(view, deadline, inputs=merged, micro_batch_buckets=1), factor
    assert 2 <= feasible_full <= 6  # the grid straddles the threshold (the test compares something)
    full = partition_lp_bound(table, lower_s=lower, iterations=8, micro_batch_buckets=1)
    bound = partition_lp_bound(table, lower_s=lower, iterations=8, max_classes=32, micro_batch_buckets=1)
    assert full * 0.995 <= bound <= full * (1 + 1e-6), (bound, full)
