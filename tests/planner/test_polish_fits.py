"""A polished baseline never places a sample at no policy.

Under ``layout="ring"`` the table prices a group of 2 as a ring (with the ring's key/value
buffers), while a baseline keeps its own layout (pure Ulysses) and can hold a sample the ring
column cannot. Before ``polish`` refused such groups, polishing the baseline gave that sample
``k_min = -1``, a plan every rank refuses to load. The batch below, on a 4-rank cluster whose
memory holds 96 tokens of the tiny model without checkpointing, is one where the baseline wins:
the plan must load, every policy a layer count.
"""

from __future__ import annotations

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.specs import ModelSpec, Sample
from planner.epoch import plan_samples
from planner.plan import Plan


def test_a_polished_baseline_keeps_every_sample_at_a_policy() -> None:
    spec = ModelSpec(name="tiny", kind="1d", num_layers=4, hidden=64, num_heads=4, ffn_hidden=128, vocab=256)
    roomy = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": 4, "gpus_per_node": 4})
    cm = CostModel(file=analytic_cost_model(spec, roomy.hardware), cluster=roomy)
    need = cm.fixed_bytes() + float(cm.activation_bytes(96, group_size=1))
    hardware = roomy.hardware.model_copy(update={"name": "tight", "hbm_bytes": need / roomy.memory_cap_fraction})
    cluster = roomy.model_copy(update={"hardware": hardware, "name": "cpu4-tight"})
    samples = [Sample(id=f"s{i}", tokens=t) for i, t in enumerate([370, 96, 42, 47, 34, 42, 35, 51])]
    result = plan_samples(samples, cluster=cluster, cost_model=analytic_cost_model(spec, hardware),
                          options={"time_limit_s": 0.5, "layout": "ring"}, step=1, seed=0)
    plan = Plan.model_validate_json(result.plan_json)  # recompute_layers >= 0, or this raises
    assert sorted(ps.sample.id for g in plan.groups for mb in g.micro_batches for ps in mb.samples) == \
        sorted(s.id for s in samples)
