"""The LPT's remembered target failures (``lpt(..., remember_failures=True)``, the default) give
the same groups, micro-batches and loads as rechecking every size for every sample (the
reference): on tiny worlds where micro-batch overheads make the target rule fail for runs of
one class (a remembered failure goes stale there when its size takes a sample: 3 of these
batches' runs differ when the version bump is left out), and on preset batches."""

from __future__ import annotations

import random

import pytest

from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.planning import prepare
from planner.search.group_state import GroupState
from planner.search.heuristic import _order, bucket_runs
from planner.search.lpt import lpt
from planner.search.multisets import candidate_multisets
from planner.workload import WorkloadSpec, sample_batch
from tests.planner.tiny import tiny_cluster, tiny_cost_model


def _state(groups: list[GroupState] | None) -> object:
    if groups is None:
        return None
    return [(g.size, g.first_rank, g.load_s, g.mbs, g.free_bytes) for g in groups]


def _check(table: CostTable, multisets: list[list[int]], *, bound_s: float,
           factors: tuple[float, ...]) -> int:
    """Runs compared (fast vs reference) that placed every sample."""
    order = _order(table)
    checked = 0
    for ms in multisets:
        for tolerance in (0.0, 0.02):
            runs = bucket_runs(table, order, tolerance=tolerance)
            for factor in factors:
                for strict in (False, True):
                    kwargs = dict(target_s=bound_s * factor, strict=strict, runs=runs)
                    fast = lpt(table, ms, order, **kwargs)
                    reference = lpt(table, ms, order, remember_failures=False, **kwargs)
                    assert _state(fast) == _state(reference), (ms, tolerance, factor, strict)
                    checked += fast is not None
    return checked


def test_tiny_worlds_give_the_reference_groups() -> None:
    cmf = tiny_cost_model()
    checked = 0
    for seed in range(40):
        rng = random.Random(seed)
        gpus = rng.choice([16, 32, 64])
        num_samples = rng.choice([200, 400])
        samples = [Sample(id=f"s{i}", tokens=rng.choice([50, 100, 150, 300, 600, 1200, 2500]))
                   for i in range(num_samples)]
        prepared = prepare(samples, cluster=tiny_cluster(num_gpus=gpus, gpus_per_node=2),
                           cost_model=cmf, config=PlannerConfig())
        multisets = [[1] * gpus, [2] * (gpus // 2), [2] * (gpus // 4) + [1] * (gpus // 2)]
        checked += _check(prepared.table, multisets, bound_s=prepared.bounds.compute_makespan_s,
                          factors=(0.9, 1.0, 1.03, 1.07, 1.15, 1.3))
    assert checked >= 100


@pytest.mark.parametrize(("workload", "gpus", "samples", "layout"),
                         [("text-longtail", 64, 1024, "auto"), ("video-short", 64, 512, "ulysses"),
                          ("text-millionctx", 128, 1024, "auto")])
def test_preset_batches_give_the_reference_groups(workload: str, gpus: int, samples: int,
                                                  layout: str) -> None:
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster("h200x64").model_copy(update={"num_gpus": gpus, "name": f"h200x{gpus}"})
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    batch = sample_batch(spec, num_samples=samples, seed=0, step=0)
    prepared = prepare(batch, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout=layout))
    bound_s = prepared.bounds.compute_makespan_s
    multisets = candidate_multisets(prepared.table, makespan_s=bound_s, limit=4)
    multisets += [[d] * (gpus // d) for d in prepared.table.sizes[:3]]
    assert _check(prepared.table, multisets, bound_s=bound_s, factors=(0.9, 1.0, 1.03, 1.15)) >= 10
