"""Every lower bound can fail its check: each is broken on purpose here (only the bound; the planner
runs for real) and the planner must refuse the plan with ``BoundError`` instead of printing a gap
that cannot be wrong. Before, the partition LP was bisected up to the plan's own step time, so an
LP that is wrongly infeasible everywhere gave a bound equal to the plan and a gap of 0."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.presets import default_cost_model_file, load_cluster
from planner.bounds.simple import BoundReport
from planner.config import PlannerConfig
from planner.planning import BoundError, plan_batch
from planner.workload import WorkloadSpec, sample_batch


def _batch() -> tuple[list, object, object]:  # type: ignore[type-arg]
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x32")
    return (sample_batch(spec, num_samples=256, seed=0, step=1), cluster,
            default_cost_model_file(spec.model, cluster.hardware.name))


CONFIG = PlannerConfig(use_cpsat=False, lp_bound_iterations=6, lp_bound_min_gap=0.0)


def test_the_real_bounds_hold_and_the_lp_runs() -> None:
    samples, cluster, file = _batch()
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]
    assert plan.lower_bound.value_s <= plan.predicted_step_time_s
    assert plan.lower_bound.kind == "partition-lp" and plan.gap > 0.001  # the LP is the bound here


def test_an_lp_infeasible_everywhere_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.bounds.lp as lp

    monkeypatch.setattr(lp, "lp_feasible", lambda *args, **kwargs: False)
    samples, cluster, file = _batch()
    with pytest.raises(BoundError, match="partition-lp"):
        plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]


def test_an_lp_feasible_too_late_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.bounds.lp as lp

    real = lp.lp_feasible
    # Feasible only from twice the true threshold: a bound above any plan near the threshold.
    monkeypatch.setattr(lp, "lp_feasible", lambda table, deadline_s, **kw: real(table, deadline_s / 2.0, **kw))
    samples, cluster, file = _batch()
    with pytest.raises(BoundError, match="partition-lp"):
        plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]


def test_an_inflated_simple_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.prepare as prepare

    real = prepare.lower_bounds

    def inflated(table):  # type: ignore[no-untyped-def]
        report = real(table)
        return dataclasses.replace(report, deadline_area_s=report.deadline_area_s * 3)

    monkeypatch.setattr(prepare, "lower_bounds", inflated)
    samples, cluster, file = _batch()
    with pytest.raises(BoundError, match="deadline-area"):
        plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]


def test_a_wrong_cpsat_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.search import cpsat

    real = cpsat.solve_exact

    def wrong(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        return dataclasses.replace(result, bound_s=None if result.bound_s is None else result.bound_s * 3)

    monkeypatch.setattr(cpsat, "solve_exact", wrong)
    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster("h200x8").model_copy(update={"name": "h200x4", "num_gpus": 4, "gpus_per_node": 4})
    samples = sample_batch(spec, num_samples=6, seed=0)  # small enough for the exact model
    with pytest.raises(BoundError, match="cpsat"):
        plan_batch(samples, cluster=cluster, cost_model=default_cost_model_file(spec.model, "h200-sxm"),
                   config=PlannerConfig(time_limit_s=5.0, layout="ulysses"))  # the exact model: no rings


def test_bound_report_names_the_tightest() -> None:
    report = BoundReport(longest_s=1.0, area_s=2.0, deadline_area_s=3.0, largest_choice_s=2.5, compute_makespan_s=3.0)
    assert report.best_s == 3.0 and report.best_kind == "deadline-area"


def test_a_job_drops_a_wrong_bound_and_says_so(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                                ) -> None:
    """What the service's workers run (planner.epoch.plan_samples) keeps planning past a wrong
    bound: the plan reports the next valid bound, the result names the dropped one, the log has
    the batch digest; asked for strict bounds, it raises as the library does."""
    import json

    import planner.bounds.lp as lp
    from planner.epoch import plan_samples
    from planner.planning import batch_digest

    monkeypatch.setattr(lp, "lp_feasible", lambda *args, **kwargs: False)
    samples, cluster, file = _batch()
    options = {"use_cpsat": False, "lp_bound_iterations": 6, "lp_bound_min_gap": 0.0}
    with caplog.at_level("ERROR", logger="planner.planning"):
        result = plan_samples(samples, cluster=cluster, cost_model=file, options=options)  # type: ignore[arg-type]
    plan = json.loads(result.plan_json)
    assert result.dropped_bounds == ("partition-lp",)
    assert plan["lower_bound"]["kind"] != "partition-lp"
    assert plan["lower_bound"]["value_s"] <= plan["predicted_step_time_s"]
    assert batch_digest(samples) in caplog.text and "dropped" in caplog.text
    with pytest.raises(BoundError):
        plan_samples(samples, cluster=cluster, cost_model=file, options={**options, "strict_bounds": True})  # type: ignore[arg-type]


def test_an_lp_bound_equal_to_the_plan_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two-sided: the LP bound set to the plan's own time would print a gap of 0 on a HEURISTIC
    plan; it is refused like a bound above the plan."""
    import planner.bounds.lp as lp

    samples, cluster, file = _batch()
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]
    assert plan.solver.status != "OPTIMAL"
    compute_s = plan.predicted_step_time_s - plan.grad_sync_time_s
    monkeypatch.setattr(lp, "partition_lp_bound", lambda *args, **kwargs: compute_s)
    with pytest.raises(BoundError, match=r"'partition-lp' .* equals the step time .* HEURISTIC plan"):
        plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]


def test_an_infinite_lp_bound_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.bounds.lp as lp

    monkeypatch.setattr(lp, "partition_lp_bound", lambda *args, **kwargs: float("inf"))
    samples, cluster, file = _batch()
    with pytest.raises(BoundError, match="'partition-lp' = inf s exceeds"):
        plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]


def test_a_claimed_proof_on_a_heuristic_plan_is_caught() -> None:
    """``cpsat-optimal`` is CP-SAT's proof: on any other plan the validator refuses it, whatever
    its value."""
    from costmodel.evaluate import CostModel
    from planner.plan import LowerBound
    from planner.validate import validate_plan

    samples, cluster, file = _batch()
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=CONFIG)  # type: ignore[arg-type]
    cm = CostModel(file=file, cluster=cluster)  # type: ignore[arg-type]
    assert validate_plan(plan, samples, cost_model=cm) == []
    for value_s in (plan.predicted_step_time_s, plan.lower_bound.value_s):
        claimed = plan.model_copy(update={"lower_bound": LowerBound(value_s=value_s, kind="cpsat-optimal")})
        assert any("'cpsat-optimal' on a HEURISTIC plan" in p for p in validate_plan(claimed, samples, cost_model=cm))
    tied = plan.model_copy(update={"lower_bound": LowerBound(value_s=plan.predicted_step_time_s, kind="partition-lp")})
    assert any("equals the step time" in p for p in validate_plan(tied, samples, cost_model=cm))
