"""The views of a ring plan: the memory view files the ring's key/value buffers under the token
working set (they live while a sample's attention runs, not kept for backward), not under the
activations; the timeline shows a pure ring's time as compute, recompute and ring, no all-to-all."""

from __future__ import annotations

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.memory_view import plan_memory
from planner.plan import Plan
from planner.planning import plan_batch
from planner.timeline import step_timeline
from planner.workload import WorkloadSpec, sample_batch


def _ring_plan() -> tuple[Plan, CostModel]:
    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster("h200x8")
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=48, seed=5, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=file,
                      config=PlannerConfig(seed=0, use_cpsat=False, layout="ring"))
    return plan, CostModel(file=file, cluster=cluster)


def test_a_pure_ring_shows_no_alltoall_in_the_timeline() -> None:
    plan, cm = _ring_plan()
    timeline = step_timeline(plan, cm)
    rings = 0
    for group, line in zip(sorted(plan.groups, key=lambda g: g.first_rank), timeline.groups, strict=True):
        for seg in line.micro_batches:
            if group.ring_degree == group.size > 1:  # u = 1: nothing to swap
                assert seg.alltoall_s == 0.0 and seg.ring_s > 0, seg
                rings += 1
    assert rings > 0
    shares = timeline.totals_rank_s()
    assert shares["alltoall"] == 0.0 and shares["ring"] > 0


def test_ring_buffers_are_token_working_memory() -> None:
    plan, cm = _ring_plan()
    file, cluster = cm.file, cm.cluster
    model, a = file.model, file.activation
    assert model.kv_heads >= cluster.num_gpus  # no key/value head replication on these groups
    L = model.num_layers
    checked = 0
    for group, mem in zip(sorted(plan.groups, key=lambda g: g.first_rank), plan_memory(plan, cm), strict=True):
        d, r = group.size, group.ring_degree
        if r == 1:
            continue
        u = d // r
        for mb, part in zip(group.micro_batches, mem.micro_batches, strict=True):
            kept = working = 0.0
            for ps in mb.samples:  # by hand from the file's coefficients (costmodel/memory_costs.py's formula)
                s, k = ps.sample.tokens, ps.recompute_layers
                kept += s / d * (max(L - k, 1 if k > 0 else 0) * a.bytes_per_token_layer_none
                                 + k * a.bytes_per_token_layer_full)
                working += s / d * (a.working_bytes_per_token + (a.alltoall_buffer_bytes_per_token if u > 1 else 0)
                                    + max(a.transient_bytes_per_token, a.head_transient_bytes_per_token))
                working += 4 * s / r * 2 * max(model.kv_heads / u, 1) * model.head_size * 2  # bf16 ring buffers
            assert part.activations_bytes == pytest.approx(kept, rel=1e-9)
            assert part.token_working_bytes == pytest.approx(working, rel=1e-9)
            checked += 1
    assert checked > 0
