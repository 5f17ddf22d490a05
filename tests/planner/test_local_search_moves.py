"""The local search's move choice (``local_search``): the pruned scoring (candidates in order of
the slowest group's time without them, skipped when the least loaded group of every size cannot
take them low enough) picks the move that scoring every ``(class, alone)`` of the slowest group
against every other group picks, first found in group order on ties."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.planning import prepare
from planner.search.group_state import GroupState, group_time, insert_sample, remove_sample
from planner.search.heuristic import _order, bucket_runs
from planner.search.local_search import local_search
from planner.search.lpt import lpt
from planner.workload import WorkloadSpec, sample_batch


def _reference_move(table: CostTable, groups: list[GroupState]) -> tuple[int, int] | None:
    """``(sample, destination)`` of the best single move off the slowest group, every candidate
    scored (no pruning), ties to the first in group order; None when none lowers the makespan."""
    cls = table.classes.class_of
    cols = np.array([g.col for g in groups], dtype=np.int64)
    o_g = table.overhead_s_by_size[cols]
    load = np.array([g.load_s for g in groups])
    max_free = np.array([max(g.free_bytes, default=-1.0) for g in groups])
    top = int(np.argmax(load))
    current = load[top]
    best: tuple[float, int, int] | None = None
    seen: set[tuple[int, bool]] = set()
    for mb in groups[top].mbs:
        alone = len(mb) == 1
        for i in mb:
            c = cls[i]
            if (c, alone) in seen:
                continue
            seen.add((c, alone))
            t_row, m_row = table.time_s[c, cols], table.mem_bytes[c, cols]
            new_src = current - t_row[top] - (o_g[top] if alone else 0.0)
            new_dst = load + t_row + o_g * (max_free < m_row)
            new_dst[top] = np.inf
            cand = np.maximum(new_dst, new_src)
            h = int(np.argmin(cand))
            if cand[h] < current * (1 - 1e-12) and (best is None or cand[h] < best[0]):
                best = (float(cand[h]), i, h)
    return None if best is None else (best[1], best[2])


def _members(groups: list[GroupState]) -> list[list[int]]:
    return [sorted(i for mb in g.mbs for i in mb) for g in groups]


@pytest.mark.parametrize(("workload", "gpus", "samples", "layout"),
                         [("text-longtail", 32, 256, "ulysses"), ("video-short", 64, 512, "auto"),
                          ("text-longtail", 256, 2048, "auto")])
def test_each_move_is_the_exhaustive_scorings(workload: str, gpus: int, samples: int, layout: str) -> None:
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster("h200x64").model_copy(update={"num_gpus": gpus, "name": f"h200x{gpus}"})
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    batch = sample_batch(spec, num_samples=samples, seed=0, step=1)
    table = prepare(batch, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout=layout)).table
    order = _order(table)
    size = table.sizes[min(2, len(table.sizes) - 1)]
    placed = lpt(table, [size] * (gpus // size), order, runs=bucket_runs(table, order, tolerance=0.02))
    assert placed is not None
    # Unbalanced on purpose (samples dealt round-robin, a third of them to the first group), so
    # that many moves pay.
    groups = [GroupState(size=g.size, col=g.col, first_rank=g.first_rank) for g in placed]
    for n, i in enumerate(order):
        insert_sample(table, groups[0 if n % 3 == 0 else n % len(groups)], i)
    for g in groups:
        g.load_s = group_time(table, g)
    moves = 0
    for _ in range(30):  # one move at a time, each checked against the reference
        expected = _reference_move(table, groups)
        after = copy.deepcopy(groups)
        local_search(table, after, max_moves=1)
        if expected is None:
            break
        i, h = expected
        want = copy.deepcopy(groups)
        top = int(np.argmax([g.load_s for g in want]))
        remove_sample(table, want[top], i)
        insert_sample(table, want[h], i)
        assert _members(after) == _members(want)
        groups = after
        moves += 1
    assert moves >= 5
