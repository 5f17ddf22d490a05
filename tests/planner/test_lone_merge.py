"""The lone-sample merge (``planner.search.resize.lone_merge``): when the slowest group runs one
sample alone, moving other samples cannot help; merging that group into one of twice the size can.
On a long-tail batch of gpt-oss-120b (a 78k-token sample, 64 GPUs) the longest sample alone on 8
GPUs outlasts every other group of an LPT over eight groups of 8."""

from __future__ import annotations

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.planning import plan_batch, prepare
from planner.search.heuristic import _order
from planner.search.lpt import lpt
from planner.search.resize import lone_merge
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch


def _batch():  # type: ignore[no-untyped-def]
    spec = WorkloadSpec.preset("text-longtail").model_copy(update={"model": "gpt-oss-120b"})
    cluster = load_cluster("h200x64", expert_parallel_size=8)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=256, seed=0, step=1)
    return cluster, cmf, samples


def test_lone_merge_gives_the_longest_sample_a_larger_group() -> None:
    cluster, cmf, samples = _batch()
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
    order = _order(table)
    groups = lpt(table, [8] * 8, order)
    assert groups is not None
    slow = max(range(len(groups)), key=lambda k: groups[k].load_s)
    held = [i for mb in groups[slow].mbs for i in mb]
    assert held == [order[0]]  # the precondition: the longest sample alone is the slowest group
    before = max(g.load_s for g in groups)
    merged = lone_merge(table, groups, max_moves=40, max_ejections=4)
    after = max(g.load_s for g in merged)
    assert after < before * 0.95, (after, before)
    home = next(g for g in merged if any(order[0] in mb for mb in g.mbs))
    assert home.size == 16
    # every sample placed once, the world partitioned
    assert sorted(i for g in merged for mb in g.mbs for i in mb) == list(range(len(samples)))
    assert sum(g.size for g in merged) == cluster.num_gpus
    assert max(g.load_s for g in groups) == before  # the input is left as it was


def test_lone_merge_leaves_a_shared_slowest_group() -> None:
    cluster, cmf, samples = _batch()
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
    groups = lpt(table, [16] * 4, _order(table))
    assert groups is not None
    slow = max(range(len(groups)), key=lambda k: groups[k].load_s)
    assert sum(len(mb) for mb in groups[slow].mbs) > 1
    assert lone_merge(table, groups, max_moves=40, max_ejections=4) is groups


def test_default_plan_of_the_batch_is_valid_and_not_bound_by_a_lone_sample() -> None:
    cluster, cmf, samples = _batch()
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig())
    assert validate_plan(plan, samples, cost_model=CostModel(file=cmf, cluster=cluster)) == []
    slowest = max(plan.groups, key=lambda g: g.predicted_time_s)
    assert sum(len(mb.samples) for mb in slowest.micro_batches) > 1
