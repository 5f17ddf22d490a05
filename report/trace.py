"""A plan's step as a Chrome trace-event JSON file (opens in the Perfetto UI and chrome://tracing).

Format: the Trace Event Format (Google, "Trace Event Format" document, the JSON Object Format
with ``traceEvents`` and ``displayTimeUnit``): complete events (``ph: "X"``) with ``ts`` and
``dur`` in microseconds, ``M`` metadata events naming processes and threads.

Layout: process 1 is the plan, one thread (track) per rank, named ``rank R (group of d at F)``.
On each rank's track, every micro-batch of its group is a slice ``micro-batch m`` whose
arguments hold the sample ids, their tokens and checkpoint policies, and inside it, as child
slices, its compute, recompute and all-to-all time (the split of ``planner.timeline``: shares of
the micro-batch's time drawn one after another, not an order in time). A group that ends before
the slowest one has an ``idle`` slice, then every rank a ``gradient sync`` slice. The slices of a
rank therefore add up to the plan's predicted step time.

A measured step (the micro-batch times ranks posted, ``executor.measure``) goes into process 2,
``measured``, with one slice per measured micro-batch on the ranks of its group, so predicted
and measured stand one above the other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan
from planner.timeline import StepTimeline

PLAN_PID = 1
"""Process id of the predicted plan's tracks."""
MEASURED_PID = 2
"""Process id of the measured step's tracks."""
US_PER_S = 1e6
"""Trace-event times are microseconds."""

KINDS = ("compute", "recompute", "alltoall")
"""The parts of a micro-batch, in the order they are drawn inside it."""
KIND_NAMES = {"compute": "compute", "recompute": "recompute", "alltoall": "all-to-all"}
"""Slice name of each part."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredMicroBatch:
    """One measured micro-batch of a group (seconds from the step's start)."""

    first_rank: int
    """Lowest rank of its group."""
    group_size: int
    """Ranks of its group."""
    index: int
    """Position in the group's order."""
    start_s: float
    """When it started, from the start of the step."""
    time_s: float
    """How long it took."""


def _slice(*, name: str, pid: int, tid: int, start_s: float, time_s: float, cat: str,
           args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                             "ts": start_s * US_PER_S, "dur": max(time_s, 0.0) * US_PER_S}
    if args:
        event["args"] = dict(args)
    return event


def _meta(*, name: str, pid: int, tid: int | None, value: str | int) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid,
                             "args": {"name" if isinstance(value, str) else "sort_index": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def plan_trace(plan: Plan, timeline: StepTimeline, *,
               measured: Sequence[MeasuredMicroBatch] = ()) -> dict[str, Any]:
    """The trace-event JSON object of ``plan`` laid out by ``timeline`` (module docstring).

    Args:
        plan: The plan.
        timeline: ``planner.timeline.step_timeline(plan, cost_model)`` of the same plan.
        measured: Measured micro-batches of the same step, if ranks posted them.

    Raises:
        ValueError: when the timeline is not the plan's (another world or other groups).
    """
    by_rank = {g.first_rank: g for g in plan.groups}
    if timeline.num_ranks != plan.num_ranks or sorted(by_rank) != [g.first_rank for g in timeline.groups]:
        raise ValueError(f"the timeline ({timeline.num_ranks} ranks, groups at "
                         f"{[g.first_rank for g in timeline.groups]}) is not the plan's "
                         f"({plan.num_ranks} ranks, groups at {sorted(by_rank)})")
    events: list[dict[str, Any]] = [
        _meta(name="process_name", pid=PLAN_PID, tid=None,
              value=f"plan (step {plan.step if plan.step is not None else '-'}, "
                    f"{plan.solver.status} {plan.solver.method})"),
        _meta(name="process_sort_index", pid=PLAN_PID, tid=None, value=0),
    ]
    makespan = timeline.compute_makespan_s
    for group_tl in timeline.groups:
        group = by_rank[group_tl.first_rank]
        if len(group.micro_batches) != len(group_tl.micro_batches):
            raise ValueError(f"group at rank {group.first_rank}: {len(group.micro_batches)} micro-batches "
                             f"in the plan, {len(group_tl.micro_batches)} in the timeline")
        for rank in group.ranks:
            events.append(_meta(name="thread_name", pid=PLAN_PID, tid=rank,
                                value=f"rank {rank} (group of {group.size} at {group.first_rank})"))
            events.append(_meta(name="thread_sort_index", pid=PLAN_PID, tid=rank, value=rank))
            for mb, seg in zip(group.micro_batches, group_tl.micro_batches, strict=True):
                events.append(_slice(
                    name=f"micro-batch {seg.index}", pid=PLAN_PID, tid=rank, start_s=seg.start_s,
                    time_s=seg.time_s, cat="micro_batch",
                    args={"group_first_rank": group.first_rank, "group_size": group.size,
                          "sample_ids": [ps.sample.id for ps in mb.samples],
                          "tokens": [ps.sample.tokens for ps in mb.samples],
                          "recompute_layers": [ps.recompute_layers for ps in mb.samples],
                          "predicted_peak_mem_bytes": mb.predicted_peak_mem_bytes}))
                clock = seg.start_s
                for kind in KINDS:
                    part_s = getattr(seg, f"{kind}_s")
                    if part_s > 0:
                        events.append(_slice(name=KIND_NAMES[kind], pid=PLAN_PID, tid=rank,
                                             start_s=clock, time_s=part_s, cat=kind))
                    clock += part_s
            idle_s = makespan - group_tl.busy_s
            if idle_s > 0:
                events.append(_slice(name="idle", pid=PLAN_PID, tid=rank, start_s=group_tl.busy_s,
                                     time_s=idle_s, cat="idle"))
            if timeline.grad_sync_s > 0:
                events.append(_slice(name="gradient sync", pid=PLAN_PID, tid=rank, start_s=makespan,
                                     time_s=timeline.grad_sync_s, cat="grad_sync"))
    if measured:
        events.append(_meta(name="process_name", pid=MEASURED_PID, tid=None, value="measured"))
        events.append(_meta(name="process_sort_index", pid=MEASURED_PID, tid=None, value=1))
        named: set[int] = set()
        for mmb in measured:
            for rank in range(mmb.first_rank, mmb.first_rank + mmb.group_size):
                if rank not in named:
                    named.add(rank)
                    events.append(_meta(name="thread_name", pid=MEASURED_PID, tid=rank,
                                        value=f"rank {rank} measured"))
                events.append(_slice(name=f"micro-batch {mmb.index}", pid=MEASURED_PID, tid=rank,
                                     start_s=mmb.start_s, time_s=mmb.time_s, cat="measured"))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"plan_digest": plan.digest(), "cost_model_id": plan.cost_model_id,
                          "cluster": plan.cluster_name, "num_ranks": plan.num_ranks,
                          "predicted_step_time_s": plan.predicted_step_time_s}}


def plan_trace_json(plan: Plan, timeline: StepTimeline, *,
                    measured: Sequence[MeasuredMicroBatch] = ()) -> str:
    """:func:`plan_trace` as compact JSON text."""
    return json.dumps(plan_trace(plan, timeline, measured=measured), separators=(",", ":"))
