"""The local search's one-for-many swap (``local_search._eject``) and the split / merge moves
of the group-size multiset (``planner.search.resize``): valid, deterministic, and strictly better
where moves and swaps between fixed groups are stuck."""

from __future__ import annotations

from collections import Counter

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.planning import plan_batch, prepare
from planner.search.group_state import GroupState, group_time
from planner.search.heuristic import _order, bucket_runs, lpt
from planner.search.local_search import local_search
from planner.search.resize import resize_search
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch


def _video_short_step5(step: int = 5):  # type: ignore[no-untyped-def]
    # Step 5: one 432k-token sample needs a 16-rank group; LPT fills that group's slack with
    # small samples it runs very inefficiently, which no single move or swap can undo.
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=256, seed=0, step=step)
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
                        config=PlannerConfig(local_search_max_ejections=e, max_resize_tries=r))
             for e, r in ((0, 0), (8, 3), (8, 3))]
    off, on, again = plans
    for plan in plans:
        assert validate_plan(plan, samples, cost_model=cm) == []
    assert on.content_digest() == again.content_digest()
    assert on.predicted_step_time_s < off.predicted_step_time_s


@pytest.mark.timeout(120)
def test_resize_improves_where_the_fixed_multiset_search_is_stuck() -> None:
    # Step 36: moves and swaps between the fixed groups 4x4 + 4x2 + 8x1 converge; resizing
    # groups (and re-placing their samples) is better. Ejections off on both sides, so only
    # the resize moves differ.
    _, cluster, cmf, samples = _video_short_step5(step=36)
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
    order = _order(table)
    groups = lpt(table, [4] * 4 + [2] * 4 + [1] * 8, order,
                 runs=bucket_runs(table, order, tolerance=0.0))
    assert groups is not None
    local_search(table, groups, max_moves=2000)
    stuck = max(g.load_s for g in groups)
    local_search(table, groups, max_moves=2000)
    assert max(g.load_s for g in groups) == stuck  # converged
    before = [(g.size, g.first_rank, [list(mb) for mb in g.mbs]) for g in groups]
    resized = resize_search(table, groups, max_tries=8, max_moves=2000, max_ejections=0)
    again = resize_search(table, groups, max_tries=8, max_moves=2000, max_ejections=0)
    # The input is left alone, and the search is deterministic.
    assert [(g.size, g.first_rank, [list(mb) for mb in g.mbs]) for g in groups] == before
    assert [(g.size, g.first_rank, g.mbs) for g in resized] == [
        (g.size, g.first_rank, g.mbs) for g in again]
    assert max(g.load_s for g in resized) < stuck * (1 - 1e-6)
    assert sorted(g.size for g in resized) != sorted(g.size for g in groups)
    assert sum(g.size for g in resized) == cluster.num_gpus
    assert sorted(g.first_rank for g in resized) == [g.first_rank for g in resized]
    for g in resized:
        assert g.load_s == pytest.approx(group_time(table, g), rel=1e-12)
    _check_groups(resized, len(samples), table.budget_bytes, table.sample_mem)


@pytest.mark.timeout(120)
def test_resize_merges_a_group_with_smaller_ones() -> None:
    # video-short, 8 GPUs, step 42: from 2 + 6x1 neither a split nor a merge of two 1-rank
    # groups improves; merging the 2-rank group with two 1-rank groups into 4 ranks does.
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x8")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=256, seed=0, step=42)
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
    order = _order(table)
    groups = lpt(table, [2] + [1] * 6, order, runs=bucket_runs(table, order, tolerance=0.0))
    assert groups is not None
    local_search(table, groups, max_moves=2000)
    stuck = max(g.load_s for g in groups)
    plain = resize_search(table, groups, max_tries=2, max_moves=2000, max_ejections=0)
    assert max(g.load_s for g in plain) == stuck
    resized = resize_search(table, groups, max_tries=3, max_moves=2000, max_ejections=0)
    assert max(g.load_s for g in resized) < stuck * (1 - 1e-6)
    assert sorted((g.size for g in resized), reverse=True) == [4, 1, 1, 1, 1]
    _check_groups(resized, len(samples), table.budget_bytes, table.sample_mem)


def test_search_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="local_search_max_ejections"):
        PlannerConfig(local_search_max_ejections=-1)
    with pytest.raises(ValueError, match="max_resize_tries"):
        PlannerConfig(max_resize_tries=-1)
    with pytest.raises(ValueError, match="deep_search_min_gap"):
        PlannerConfig(deep_search_min_gap=-0.1)


def test_ejection_spill_scan_and_vector_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small worlds spill an ejection's overflow with a plain scan, large ones with numpy: the
    same moves either way (the same sums, the lowest index among equal finishes)."""
    import planner.search.local_search as ls

    _, cluster, cmf, samples = _video_short_step5()

    def ejected(scan_max_groups: int) -> list[tuple[int, list[list[int]], float]]:
        monkeypatch.setattr(ls, "_SPILL_SCAN_GROUPS", scan_max_groups)
        table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
        order = _order(table)
        groups = lpt(table, [16, 8] + [1] * 8, order,
                     runs=bucket_runs(table, order, tolerance=0.0))
        assert groups is not None
        local_search(table, groups, max_moves=2000, max_ejections=8)
        return [(g.first_rank, g.mbs, g.load_s) for g in groups]

    assert ejected(0) == ejected(10_000)
