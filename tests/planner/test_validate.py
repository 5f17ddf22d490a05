"""The validator catches every broken invariant."""

from __future__ import annotations

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from planner.config import PlannerConfig
from planner.plan import GroupPlan, Plan
from planner.planning import plan_batch
from planner.validate import assert_valid_plan, validate_plan
from planner.workload import WorkloadSpec, sample_batch


@pytest.fixture(scope="module")
def video() -> tuple[list[Sample], CostModel, Plan]:
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=64, seed=2, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf)
    return samples, CostModel(file=cmf, cluster=cluster), plan


def _replace_group(plan: Plan, index: int, group: GroupPlan) -> Plan:
    groups = list(plan.groups)
    groups[index] = group
    return plan.model_copy(update={"groups": groups})


def _busy_group(plan: Plan) -> int:
    return next(i for i, g in enumerate(plan.groups) if g.micro_batches)


def test_a_valid_plan_has_no_problems(video: tuple[list[Sample], CostModel, Plan]) -> None:
    samples, cm, plan = video
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert_valid_plan(plan, samples, cost_model=cm)


def test_a_dropped_sample_is_reported(video: tuple[list[Sample], CostModel, Plan]) -> None:
    samples, cm, plan = video
    extra = Sample(id="not-planned", tokens=100)
    problems = validate_plan(plan, [*samples, extra], cost_model=cm)
    assert any("missing" in p and "not-planned" in p for p in problems)
    with pytest.raises(ValueError, match="missing"):
        assert_valid_plan(plan, [*samples, extra], cost_model=cm)


def test_a_duplicated_sample_is_reported(video: tuple[list[Sample], CostModel, Plan]) -> None:
    samples, cm, plan = video
    gi = _busy_group(plan)
    group = plan.groups[gi]
    mbs = [*group.micro_batches, group.micro_batches[0]]
    broken = _replace_group(plan, gi, group.model_copy(update={"micro_batches": mbs}))
    problems = validate_plan(broken, samples, cost_model=cm)
    assert any("appears 2 times" in p for p in problems)


def test_a_sample_not_in_the_batch_is_reported(video: tuple[list[Sample], CostModel, Plan]) -> None:
    samples, cm, plan = video
    problems = validate_plan(plan, samples[1:], cost_model=cm)
    assert any("not in the batch" in p for p in problems)


def test_memory_over_the_cap_is_reported(video: tuple[list[Sample], CostModel, Plan]) -> None:
    samples, cm, plan = video
    gi = _busy_group(plan)
    group = plan.groups[gi]
    mb = group.micro_batches[0]
    huge = mb.samples[0].model_copy(update={"sample": Sample(id=mb.samples[0].sample.id,
                                                             tokens=10_000_000)})
    bad_mb = mb.model_copy(update={"samples": [huge, *mb.samples[1:]]})
    broken = _replace_group(plan, gi, group.model_copy(
        update={"micro_batches": [bad_mb, *group.micro_batches[1:]]}))
    problems = validate_plan(broken, samples, cost_model=cm)
    assert any("exceeds the cap" in p for p in problems)
    assert any("different shape" in p for p in problems)


def test_a_wrong_prediction_is_reported(video: tuple[list[Sample], CostModel, Plan]) -> None:
    samples, cm, plan = video
    broken = plan.model_copy(update={"predicted_step_time_s": plan.predicted_step_time_s * 0.5})
    problems = validate_plan(broken, samples, cost_model=cm)
    assert any("step time predicted" in p for p in problems)


def test_a_group_straddling_nodes_is_reported() -> None:
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file("llama-7b", cluster.hardware.name)
    cm = CostModel(file=cmf, cluster=cluster)
    samples = [Sample(id=f"x{i}", tokens=2048) for i in range(40)]
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(group_sizes=(4,), compute_baselines=False))
    assert validate_plan(plan, samples, cost_model=cm) == []
    # Swap ranks between the groups at 4 and 8: [6..9] crosses the node boundary at 8.
    broken_groups = list(plan.groups)
    idx = plan.groups.index(next(g for g in plan.groups if g.first_rank == 4))
    broken_groups[idx] = broken_groups[idx].model_copy(update={"ranks": [6, 7, 8, 9]})
    other = plan.groups.index(next(g for g in plan.groups if g.first_rank == 8))
    broken_groups[other] = broken_groups[other].model_copy(update={"ranks": [4, 5, 10, 11]})
    broken = plan.model_copy(update={"groups": broken_groups})
    problems = validate_plan(broken, samples, cost_model=cm)
    assert any("straddles nodes" in p for p in problems)
