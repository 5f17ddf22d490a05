"""``static-best`` tries sizes in order of their floors and skips those that cannot win: its step
time is the best of every size's LPT draft (no size skipped), the smaller size on ties."""

from __future__ import annotations

import pytest

from costmodel.presets import default_cost_model_file, load_cluster
from planner.assemble import BatchArrays, draft_step_time_s
from planner.baselines.static_best import lpt_draft, static_best_draft
from planner.config import PlannerConfig
from planner.planning import prepare
from planner.workload import WorkloadSpec, sample_batch


@pytest.mark.parametrize(("workload", "gpus", "samples", "layout", "step"),
                         [("text-longtail", 64, 512, "ulysses", 0), ("text-longtail", 256, 2048, "auto", 1),
                          ("video-short", 64, 256, "ulysses", 5), ("text-millionctx", 128, 1024, "auto", 0)])
def test_static_best_is_the_best_size_of_all(workload: str, gpus: int, samples: int, layout: str, step: int) -> None:
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster("h200x64").model_copy(update={"num_gpus": gpus, "name": f"h200x{gpus}"})
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    batch = sample_batch(spec, num_samples=samples, seed=0, step=step)
    table = prepare(batch, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout=layout)).table
    arrays = BatchArrays.of(table.samples)
    every = []
    for d in table.sizes:
        draft = lpt_draft(table, group_size=d)
        if draft is not None:
            every.append((draft_step_time_s(draft, arrays, table.cost_model, grad_sync_s=table.grad_sync_s), d, draft))
    assert every
    best_s, _, best_draft = min(every, key=lambda e: (e[0], e[1]))
    chosen = static_best_draft(table)
    assert chosen == best_draft
    assert draft_step_time_s(chosen, arrays, table.cost_model, grad_sync_s=table.grad_sync_s) == best_s
