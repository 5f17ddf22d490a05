"""The local search's one-for-many swap (``local_search._eject``): valid, deterministic, and
strictly better where moves and swaps between fixed groups are stuck."""

from __future__ import annotations

from collections import Counter

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.heuristic import _order, bucket_runs, lpt
from planner.local_search import GroupState, group_time, local_search
from planner.planning import plan_batch, prepare
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch


def _video_short_step5():  # type: ignore[no-untyped-def]
    # One 432k-token sample needs a 16-rank group; LPT fills that group's slack with small
    # samples it runs very inefficiently, which no single move or swap can undo.
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=256, seed=0, step=5)
    return spec, cluster, cmf, samples


def _check_groups(groups: list[GroupState], num_samples: int, budget_bytes: float,
                  mem_of) -> None:  # type: ignore[no-untyped-def]
    placed = Counter(i for g in groups for mb in g.mbs for i in mb)
    assert sorted(placed) == list(range(num_samples))
    assert set(placed.values()) == {1}
    for g in groups:
        for mb in g.mbs:
            assert mb
            assert sum(mem_of(i, g.col) for i in mb) <= budget_bytes * (1 + 1e-12)


@pytest.mark.timeout(120)
def test_ejection_improves_where_moves_and_swaps_are_stuck() -> None:
    _, cluster, cmf, samples = _video_short_step5()
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
    order = _order(table)
    groups = lpt(table, [16, 8] + [1] * 8, order, runs=bucket_runs(table, order, tolerance=0.0))
    assert groups is not None
    local_search(table, groups, max_moves=2000, max_ejections=0)
    stuck = max(g.load_s for g in groups)
    # Converged: more moves and swaps change nothing.
    local_search(table, groups, max_moves=2000, max_ejections=0)
    assert max(g.load_s for g in groups) == stuck
    local_search(table, groups, max_moves=2000, max_ejections=8)
    improved = max(g.load_s for g in groups)
    assert improved < stuck * (1 - 1e-6)
    for g in groups:
        assert g.load_s == pytest.approx(group_time(table, g), rel=1e-12)
    _check_groups(groups, len(samples), table.budget_bytes, table.sample_mem)


@pytest.mark.timeout(120)
def test_plans_with_ejections_are_valid_deterministic_and_no_worse() -> None:
    spec, cluster, cmf, samples = _video_short_step5()
    cm = CostModel(file=cmf, cluster=cluster)
    plans = [plan_batch(samples, cluster=cluster, cost_model=cmf, step=5,
                        reference_sample=spec.max_sample,
                        config=PlannerConfig(local_search_max_ejections=e)) for e in (0, 8, 8)]
    off, on, again = plans
    for plan in plans:
        assert validate_plan(plan, samples, cost_model=cm) == []
    assert on.content_digest() == again.content_digest()
    assert on.predicted_step_time_s < off.predicted_step_time_s


def test_ejection_count_is_validated() -> None:
    with pytest.raises(ValueError, match="local_search_max_ejections"):
        PlannerConfig(local_search_max_ejections=-1)
