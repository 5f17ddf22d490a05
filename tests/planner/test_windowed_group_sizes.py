"""Sliding-window layers make long samples cheap: the planner gives a long sample a smaller group
under gpt-oss-20b and Gemma-3-27B than under the same model with full attention in every layer
(same widths, experts and memory), because the windowed layers' attention is linear in the sample.

Gemma-3-27B's model states do not fit an H200 under ZeRO-1 (108 GB of bf16 parameters and
gradients), so it runs on an H200 with 4x the memory, where compute alone picks the sizes;
gpt-oss-20b splits its experts over 8 ranks (costed expert parallelism) to leave room for activations.
"""

from __future__ import annotations

import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.presets import load_cluster, load_hardware, load_model
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from planner.planning import plan_batch

pytestmark = pytest.mark.timeout(300)


def _long_group_sizes(model: ModelSpec, cluster: ClusterSpec, *, num_short: int) -> list[int]:
    samples = [Sample(id="long", tokens=131072)] + [Sample(id=f"s{i}", tokens=4096) for i in range(num_short)]
    plan = plan_batch(samples, cluster=cluster, cost_model=analytic_cost_model(model, cluster.hardware), step=0)
    return [len(g.ranks) for g in plan.groups for mb in g.micro_batches for ps in mb.samples
            if ps.sample.id == "long"]


def _full_attention_twin(model: ModelSpec) -> ModelSpec:
    return ModelSpec(**{**model.model_dump(), "name": f"{model.name}-full", "layer_types": None,
                        "sliding_window": None})


@pytest.mark.parametrize(("name", "hbm_scale", "expert_parallel_size", "num_short"), [
    ("gpt-oss-20b", 1.0, 8, 300),
    ("gemma-3-27b", 4.0, 1, 120),
])
def test_windowed_models_give_long_samples_smaller_groups(name: str, hbm_scale: float, expert_parallel_size: int,
                                                          num_short: int) -> None:
    hardware = load_hardware("h200-sxm")
    hardware = hardware.model_copy(update={"hbm_bytes": hardware.hbm_bytes * hbm_scale})
    cluster = load_cluster("h200x64", hardware=hardware, expert_parallel_size=expert_parallel_size)
    model = load_model(name)
    windowed = _long_group_sizes(model, cluster, num_short=num_short)
    full = _long_group_sizes(_full_attention_twin(model), cluster, num_short=num_short)
    assert windowed == [16] and full == [32], (windowed, full)
