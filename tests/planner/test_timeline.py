"""planner.timeline splits each micro-batch by differences of the cost model's own times;
planner.baseline_plan rebuilds the plans whose step times plan_batch records in baselines_s."""

from __future__ import annotations

import math

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from planner.baseline_plan import baseline_plan, rebuilt_matches, strongest_baseline_plan
from planner.baselines import strongest
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch
from planner.timeline import step_timeline, without_alltoall
from planner.workload import WorkloadSpec, sample_batch


@pytest.fixture(scope="module", params=[("text-longtail", "h200x32"), ("video-short", "h200x8")])
def planned(request: pytest.FixtureRequest) -> tuple[Plan, list[Sample], CostModel, PlannerConfig, Sample]:
    workload, cluster_name = request.param
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=96, seed=1, step=0)
    config = PlannerConfig(seed=5, use_cpsat=False)
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=config, step=0,
                      reference_sample=spec.max_sample)
    return plan, samples, CostModel(file=file, cluster=cluster), config, spec.max_sample


def test_segments_add_up_to_the_plans_predictions(planned: tuple) -> None:
    plan, _, cm, _, _ = planned
    tl = step_timeline(plan, cm)
    assert tl.step_time_s == pytest.approx(plan.predicted_step_time_s, rel=1e-9)
    assert tl.grad_sync_s == plan.grad_sync_time_s
    by_rank = {g.first_rank: g for g in plan.groups}
    saw_alltoall = saw_recompute = False
    for g in tl.groups:
        group = by_rank[g.first_rank]
        assert len(g.micro_batches) == len(group.micro_batches)
        assert g.busy_s == pytest.approx(group.predicted_time_s, rel=1e-9)
        for seg, mb in zip(g.micro_batches, group.micro_batches, strict=True):
            assert seg.time_s == pytest.approx(mb.predicted_time_s, rel=1e-9)
            assert min(seg.compute_s, seg.recompute_s, seg.alltoall_s) >= 0
            assert seg.compute_s > 0
            # No all-to-all on one rank; no recompute without checkpointing.
            if g.size == 1:
                assert seg.alltoall_s == 0
            else:
                assert seg.alltoall_s > 0
                saw_alltoall = True
            if all(ps.recompute_layers == 0 for ps in mb.samples):
                assert seg.recompute_s == 0
            else:
                assert seg.recompute_s > 0
                saw_recompute = True
    assert saw_alltoall  # the instances exercise both kinds
    totals = tl.totals_rank_s()
    assert sum(totals.values()) == pytest.approx(tl.step_time_s * plan.num_ranks, rel=1e-9)
    assert saw_recompute or totals["recompute"] == 0


def test_alltoall_removed_model_times_single_ranks_alike(planned: tuple) -> None:
    plan, _, cm, _, _ = planned
    bare = without_alltoall(cm)
    one = [g for g in plan.groups if g.size == 1 and g.micro_batches]
    for g in one:
        mb = g.micro_batches[0]
        samples = [ps.sample for ps in mb.samples]
        ks = [ps.recompute_layers for ps in mb.samples]
        assert bare.microbatch_time_s(samples, group_size=1, recompute_layers=ks) == pytest.approx(
            cm.microbatch_time_s(samples, group_size=1, recompute_layers=ks), rel=1e-12)


def test_a_plan_of_another_cost_model_is_refused(planned: tuple) -> None:
    plan, _, cm, _, _ = planned
    slower = cm.file.model_copy(update={"compute": cm.file.compute.model_copy(
        update={"microbatch_overhead_s": cm.file.compute.microbatch_overhead_s + 0.01})})
    with pytest.raises(ValueError, match="use the cost model and cluster the plan was made with"):
        step_timeline(plan, CostModel(file=slower, cluster=cm.cluster))
    with pytest.raises(ValueError, match="ranks"):
        other = "h200x8" if plan.num_ranks != 8 else "h200x32"
        step_timeline(plan, CostModel(file=cm.file, cluster=load_cluster(other)))


def test_every_rebuilt_baseline_has_its_recorded_step_time(planned: tuple) -> None:
    plan, samples, cm, config, reference = planned
    assert plan.baselines_s
    for name, recorded in plan.baselines_s.items():
        rebuilt = baseline_plan(samples, name=name, cluster=cm.cluster, cost_model=cm.file, config=config,
                                reference_sample=reference)
        assert rebuilt.solver.method == name and sorted(rebuilt.sample_ids) == sorted(plan.sample_ids)
        assert math.isclose(rebuilt.predicted_step_time_s, recorded, rel_tol=1e-9), name
        assert rebuilt_matches(plan, rebuilt)
    best = strongest_baseline_plan(plan, samples, cluster=cm.cluster, cost_model=cm.file, config=config,
                                   reference_sample=reference)
    assert best is not None and best.solver.method == strongest(plan.baselines_s)[0]  # type: ignore[index]


def test_unknown_baseline_is_named() -> None:
    cluster = load_cluster("h200x8")
    file = default_cost_model_file("llama-7b", "h200-sxm")
    with pytest.raises(ValueError, match="unknown baseline 'nosuch'"):
        baseline_plan([Sample(id="a", tokens=1024)], name="nosuch", cluster=cluster, cost_model=file,
                      config=PlannerConfig())
