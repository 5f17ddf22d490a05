"""``auto`` by default: the planner's default layout, the per-group reason for a ring (its saving
against pure Ulysses of its size, on the plan's groups) and the in-node margin a ring must beat."""

from __future__ import annotations

import dataclasses

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.schema import TermFit
from costmodel.specs import Sample
from planner.assemble import BatchArrays, DraftGroup, PlanMeta, assemble_plan
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.layouts import DEFAULT_IN_NODE_RING_MARGIN, choose_group_layouts, in_node_ring_margin, layout_options
from planner.plan import GroupPlan, LowerBound
from planner.planning import plan_batch, prepare
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch
from tests.planner.tiny import tiny_cluster, tiny_cost_model


def test_the_default_layout_is_auto() -> None:
    assert PlannerConfig().layout == "auto"
    with pytest.raises(ValueError, match="in_node_ring_margin"):
        PlannerConfig(in_node_ring_margin=1.0)


def test_a_ring_group_says_what_it_saves_against_pure_ulysses() -> None:
    spec = WorkloadSpec.preset("text-millionctx")
    cluster = load_cluster("h200x32")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=64, seed=1, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf)  # the default: auto
    cm = CostModel(file=cmf, cluster=cluster)
    assert validate_plan(plan, samples, cost_model=cm) == []
    rings = [g for g in plan.groups if g.ring_degree > 1]
    assert rings and all(g.ring_saving_s is not None for g in rings)
    assert all("ring_saving_s" not in g.model_dump() or g.ring_degree > 1 for g in plan.groups)
    index = {s.id: i for i, s in enumerate(samples)}
    full = cm.num_layers - 1
    meta = PlanMeta(status="HEURISTIC", method="test", wall_time_s=0.0,
                    lower_bound=LowerBound(value_s=0.0, kind="none"))
    budget = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table.budget_bytes
    limit = cm.fixed_bytes() + budget

    def ulysses_group(g: GroupPlan, mbs: list[list[tuple[int, int]]]) -> GroupPlan:
        return assemble_plan([DraftGroup(size=len(g.ranks), first_rank=g.ranks[0], micro_batches=mbs)], samples,
                             cost_model=cm, meta=meta).groups[0]

    for g in rings:
        # The same ranks and micro-batches as pure Ulysses: each micro-batch at its policies, or fully
        # checkpointed where pure Ulysses cannot hold it so (a ring keeps fewer bytes per rank).
        mbs = [[(index[p.sample.id], p.recompute_layers) for p in mb.samples] for mb in g.micro_batches]
        same = ulysses_group(g, mbs)
        mbs = [mb if peak.predicted_peak_mem_bytes <= limit else [(i, full) for i, _ in mb]
               for mb, peak in zip(mbs, same.micro_batches, strict=True)]
        alt = ulysses_group(g, mbs)
        assert all(mb.predicted_peak_mem_bytes <= limit for mb in alt.micro_batches)
        assert g.ring_saving_s is not None and g.ring_saving_s > 0  # this ring is chosen for a reason
        assert g.ring_saving_s == pytest.approx(alt.predicted_time_s - g.predicted_time_s, rel=1e-9)
    # Shown in the plan's JSON only where a ring runs: pure-Ulysses plans keep their bytes.
    uly = plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout="ulysses"))
    assert "ring_saving_s" not in uly.model_dump_json()


def _tiny(tokens: int, gpus_per_node: int) -> tuple[CostModel, CostTable, BatchArrays, DraftGroup]:
    cm = CostModel(file=tiny_cost_model(num_heads=4), cluster=tiny_cluster(num_gpus=4, gpus_per_node=gpus_per_node))
    samples = [Sample(id="a", tokens=tokens)]
    options = layout_options(cm, layout="auto", mode="pow2", max_group_size=None, explicit=None)
    assert options[4][0] == 1 and options[4][-1] == 4  # pure Ulysses and the pure ring of 4
    table = CostTable(cm, samples, sizes=list(options), ring_options=options)
    return cm, table, BatchArrays.of(samples), DraftGroup(size=4, first_rank=0, micro_batches=[[(0, 0)]])


def test_inside_a_node_a_ring_must_save_more_than_the_margin() -> None:
    # The tiny model prices a ring of 4 at 400 tokens 4.3% under pure Ulysses, at 64 tokens 15% under.
    _, table, arrays, group = _tiny(400, gpus_per_node=4)
    assert choose_group_layouts([group], arrays, table)[0].ring_degree == 4  # no margin: the fastest
    assert choose_group_layouts([group], arrays, table, in_node_margin=0.04)[0].ring_degree == 4
    assert choose_group_layouts([group], arrays, table, in_node_margin=0.05)[0].ring_degree == 1
    # a group given as a ring goes back to pure Ulysses too
    ring = dataclasses.replace(group, ring_degree=4)
    assert choose_group_layouts([ring], arrays, table, in_node_margin=0.05)[0].ring_degree == 1
    _, table, arrays, group = _tiny(64, gpus_per_node=4)
    assert choose_group_layouts([group], arrays, table, in_node_margin=0.05)[0].ring_degree == 4
    # across nodes (two of 2 GPUs) the margin does not apply
    _, table, arrays, group = _tiny(400, gpus_per_node=2)
    chosen = choose_group_layouts([group], arrays, table)[0].ring_degree
    assert choose_group_layouts([group], arrays, table, in_node_margin=0.9)[0].ring_degree == chosen


def test_the_margin_is_the_fits_held_out_error_else_the_default() -> None:
    cm, *_ = _tiny(400, gpus_per_node=4)
    assert cm.file.fit_quality == {}
    assert in_node_ring_margin(PlannerConfig(), cm) == DEFAULT_IN_NODE_RING_MARGIN
    assert in_node_ring_margin(PlannerConfig(in_node_ring_margin=0.0), cm) == 0.0
    quality = {"compute_time": TermFit(mape=0.021, num_points=40, num_heldout=10),
               "ring_attention": TermFit(mape=0.034, num_points=30, num_heldout=8),
               "activation_bytes": TermFit(mape=0.2, num_points=40, num_heldout=10)}  # not a time term
    fitted = CostModel(file=cm.file.model_copy(update={"fit_quality": quality}), cluster=cm.cluster)
    assert in_node_ring_margin(PlannerConfig(), fitted) == 0.034


def test_an_epoch_stored_without_a_layout_keeps_planning_as_ulysses() -> None:
    from planner.epoch import build_config, epoch_options

    old = {"options": {"time_limit_s": 2.0}}  # stored when ulysses was the default
    assert build_config(epoch_options(old)).layout == "ulysses"
    new = {"options": {"time_limit_s": 2.0, "layout": "auto"}}
    assert epoch_options(new) == new["options"] and build_config(epoch_options(new)).layout == "auto"
