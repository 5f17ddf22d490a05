"""The memory view: parts that add up to the plan's own predicted peaks, model states that are the
ZeRO figures of the cluster's sharding, and a chart with one bar per group and part."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.memory_view import plan_memory
from planner.plan import Plan
from planner.planning import plan_batch
from planner.workload import WorkloadSpec, sample_batch
from report.memory import MAX_BARS, memory_image

SVG = "{http://www.w3.org/2000/svg}"


def _plan(workload: str, cluster_name: str, num_samples: int) -> tuple[Plan, CostModel]:
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=num_samples, seed=5, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=PlannerConfig(seed=0, use_cpsat=False))
    return plan, CostModel(file=file, cluster=cluster)


@pytest.fixture(scope="module")
def text_plan() -> tuple[Plan, CostModel]:
    return _plan("text-longtail", "h200x8", 48)


def test_parts_add_up_to_the_plans_peaks(text_plan: tuple[Plan, CostModel]) -> None:
    plan, cm = text_plan
    groups = plan_memory(plan, cm)
    assert [g.first_rank for g in groups] == sorted(g.first_rank for g in plan.groups)
    by_rank = {g.first_rank: g for g in plan.groups}
    num_params = cm.file.num_params
    world = plan.num_ranks
    for g in groups:
        group = by_rank[g.first_rank]
        assert len(g.micro_batches) == len(group.micro_batches)
        for mem, mb in zip(g.micro_batches, group.micro_batches, strict=True):
            assert mem.peak_bytes == pytest.approx(mb.predicted_peak_mem_bytes, rel=1e-9)
            assert mem.margin_bytes == pytest.approx(cm.cluster.memory_cap_bytes - mb.predicted_peak_mem_bytes)
            assert mem.margin_bytes >= 0  # a valid plan stays under its cap
            # Activations kept are the samples' own predicted bytes less their per-token working set.
            samples_bytes = sum(ps.predicted_activation_bytes for ps in mb.samples)
            assert mem.activations_bytes + mem.token_working_bytes == pytest.approx(samples_bytes, rel=1e-9)
            assert 0 < mem.token_working_bytes < samples_bytes
            # ZeRO (Rajbhandari et al. 2020): 2 + 2 bytes of bf16 params and grads, 12 bytes of fp32
            # master weights and Adam moments sharded over the world under the default zero1.
            assert cm.cluster.state_sharding == "zero1" and cm.cluster.grad_sync == "allreduce"
            assert mem.params_bytes == pytest.approx(2 * num_params)
            assert mem.grads_bytes == pytest.approx(2 * num_params)
            assert mem.optimizer_bytes == pytest.approx(12 * num_params / world)


def test_a_plan_of_another_cost_model_is_refused(text_plan: tuple[Plan, CostModel]) -> None:
    plan, cm = text_plan
    other = CostModel(file=default_cost_model_file("llama-13b", cm.cluster.hardware.name), cluster=cm.cluster)
    with pytest.raises(ValueError, match="peak"):
        plan_memory(plan, other)


def test_chart_has_a_bar_per_group_and_part_and_the_measured_peak(text_plan: tuple[Plan, CostModel]) -> None:
    plan, cm = text_plan
    first = min(g.first_rank for g in plan.groups)
    groups = plan_memory(plan, cm, measured_peaks_bytes={first: 50e9})
    svg = memory_image(groups, title="t", hbm_bytes=cm.cluster.hardware.hbm_bytes, fmt="svg")
    ids = {g.get("id") for g in ET.fromstring(svg).iter(f"{SVG}g")}
    working = [g for g in groups if g.micro_batches]
    for part in ("params", "grads", "optimizer", "fixed_working", "activations", "token_working", "margin"):
        assert {f"memory-{part}-{x}" for x in range(len(working))} <= ids, part
    assert b"measured peak" in svg
    assert memory_image(groups, title="t", hbm_bytes=cm.cluster.hardware.hbm_bytes, fmt="png").startswith(b"\x89PNG")


def test_many_groups_fold_into_one_bar_per_size() -> None:
    plan, cm = _plan("text-longtail", "h200x256", 512)
    groups = plan_memory(plan, cm)
    working = [g for g in groups if g.micro_batches]
    assert len(working) > MAX_BARS  # the fold is exercised
    svg = memory_image(groups, title="t", hbm_bytes=cm.cluster.hardware.hbm_bytes, fmt="svg")
    bars = {g.get("id") for g in ET.fromstring(svg).iter(f"{SVG}g") if (g.get("id") or "").startswith("memory-params-")}
    assert len(bars) == len({g.size for g in working})
    texts = " ".join("".join(t.itertext()) for t in ET.fromstring(svg).iter(f"{SVG}text"))
    assert "one bar per size" in texts


def test_the_micro_batch_dots_are_in_the_legend(text_plan: tuple[Plan, CostModel]) -> None:
    plan, cm = text_plan
    svg = memory_image(plan_memory(plan, cm), title="t", hbm_bytes=cm.cluster.hardware.hbm_bytes, fmt="svg")
    texts = " ".join("".join(t.itertext()) for t in ET.fromstring(svg).iter(f"{SVG}text"))
    assert texts.count("peak of each micro-batch") == 1
