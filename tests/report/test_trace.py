"""The trace export is a valid trace-event file whose slices are the plan's own figures: one track
per rank, one micro-batch slice per micro-batch of the rank's group with its samples, its parts
inside it, and slices that add up to the plan's predicted step time on every rank."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch
from planner.timeline import step_timeline
from planner.workload import WorkloadSpec, sample_batch
from report.trace import MEASURED_PID, PLAN_PID, MeasuredMicroBatch, plan_trace, plan_trace_json

US = 1e6


@pytest.fixture(scope="module")
def planned() -> tuple[Plan, CostModel]:
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x64")
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=256, seed=3, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=PlannerConfig(seed=0, use_cpsat=False),
                      step=0)
    return plan, CostModel(file=file, cluster=cluster)


def _check_event(event: dict[str, Any]) -> None:
    """The Trace Event Format's fields of a complete (X) or metadata (M) event."""
    assert event["ph"] in ("X", "M"), event
    assert isinstance(event["name"], str) and event["name"], event
    assert isinstance(event["pid"], int), event
    if event["ph"] == "X":
        assert isinstance(event["tid"], int) and event["tid"] >= 0, event
        assert isinstance(event["ts"], float) and event["ts"] >= 0, event
        assert isinstance(event["dur"], float) and event["dur"] >= 0, event
    else:
        assert event["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
        assert isinstance(event["args"], dict) and len(event["args"]) == 1


def test_trace_of_a_64_gpu_plan_matches_the_plan(planned: tuple[Plan, CostModel]) -> None:
    plan, cm = planned
    trace = json.loads(plan_trace_json(plan, step_timeline(plan, cm)))
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    events = trace["traceEvents"]
    for event in events:
        _check_event(event)
    tracks = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == set(range(plan.num_ranks))
    slices: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["pid"] == PLAN_PID
            slices[e["tid"]].append(e)
    for group in plan.groups:
        for rank in group.ranks:
            top = sorted((e for e in slices[rank] if e["cat"] in ("micro_batch", "idle", "grad_sync")),
                         key=lambda e: e["ts"])
            mbs = [e for e in top if e["cat"] == "micro_batch"]
            assert len(mbs) == len(group.micro_batches)
            # The micro-batch slices are the plan's micro-batches: durations, samples, tokens.
            for e, mb in zip(mbs, group.micro_batches, strict=True):
                assert e["dur"] == pytest.approx(mb.predicted_time_s * US, rel=1e-6)
                assert e["args"]["sample_ids"] == [ps.sample.id for ps in mb.samples]
                assert e["args"]["tokens"] == [ps.sample.tokens for ps in mb.samples]
                parts = [c for c in slices[rank] if c["cat"] in ("compute", "recompute", "alltoall")
                         and e["ts"] - 1e-6 <= c["ts"] and c["ts"] + c["dur"] <= e["ts"] + e["dur"] + 1e-3]
                assert math.fsum(c["dur"] for c in parts) == pytest.approx(e["dur"], rel=1e-6)
            # Top-level slices tile the step on every rank: no gap, no overlap, the step's time.
            clock = 0.0
            for e in top:
                assert e["ts"] == pytest.approx(clock, abs=1e-3)
                clock = e["ts"] + e["dur"]
            assert clock == pytest.approx(plan.predicted_step_time_s * US, rel=1e-6)
    # Every sample of the batch appears once per group rank, so once on each group's first rank.
    firsts = [s for g in plan.groups for e in slices[g.first_rank] if e["cat"] == "micro_batch"
              for s in e["args"]["sample_ids"]]
    assert sorted(firsts) == sorted(plan.sample_ids)


def test_measured_micro_batches_get_their_own_process(planned: tuple[Plan, CostModel]) -> None:
    plan, cm = planned
    group = plan.groups[0]
    measured = [MeasuredMicroBatch(first_rank=group.first_rank, group_size=group.size, index=i,
                                   start_s=0.01 * i, time_s=0.01) for i in range(len(group.micro_batches))]
    events = plan_trace(plan, step_timeline(plan, cm), measured=measured)["traceEvents"]
    mine = [e for e in events if e["pid"] == MEASURED_PID and e["ph"] == "X"]
    assert len(mine) == group.size * len(group.micro_batches)
    assert {e["tid"] for e in mine} == set(group.ranks)


def test_a_timeline_of_another_plan_is_refused(planned: tuple[Plan, CostModel]) -> None:
    plan, cm = planned
    other = plan.model_copy(update={"num_ranks": plan.num_ranks})
    timeline = step_timeline(other, cm)
    shifted = type(timeline)(groups=timeline.groups[1:], compute_makespan_s=timeline.compute_makespan_s,
                             grad_sync_s=timeline.grad_sync_s, num_ranks=timeline.num_ranks)
    with pytest.raises(ValueError, match="not the plan's"):
        plan_trace(plan, shifted)
