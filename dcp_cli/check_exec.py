"""Plans through the executor for ``dcp check-model``: each micro-batch timed on its group's gloo
ranks (and, for groups of several ranks, on an emulated group: what the compute profile
predicts) and its peak of live bytes, plus one calibration micro-batch per rank.

How the micro-batches are timed and measured is described in :mod:`dcp_cli.model_check` (step 4).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.specs import Sample
from dcp_cli.check_comm import AllToAllMeter
from dcp_cli.check_config import CheckConfig, build_reference_model, rank_results, read_rank_results, run_as_profiled
from dcp_cli.net import free_port
from executor.context import SPContext
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.layout import PackedLayout, SampleShape
from executor.runtime import Executor
from executor.ulysses import EmulatedGroup
from planner.plan import Plan

__all__ = ["calibration_sample", "execute", "execute_rank"]


def calibration_sample(config: CheckConfig) -> Sample:
    """One sample of half the longest size: its micro-batch's peak less its predicted activations
    is the fixed working memory (on few tokens the peak is the parameter gradients' buffers, not
    activations, so a tiny sample would overstate it)."""
    tokens = max(8, 8 * (config.tokens_max // 16))
    if config.kind == "1d":
        return Sample(id="calibration", tokens=tokens)
    return Sample(id="calibration", tokens=tokens, frames=2, height=4, width=tokens // 8)


def _calibration_peak(model: Any, config: CheckConfig) -> float:
    """Peak live bytes of the calibration micro-batch on one rank."""
    sample = calibration_sample(config)
    data = SyntheticDataset([sample], kind=config.kind, vocab=config.vocab,
                            channels=config.model_config.in_channels, seed=config.seed)
    item = data.load(sample)
    layout = PackedLayout(samples=(SampleShape(tokens=sample.tokens, frames=sample.num_frames),),
                          group_size=1, index_in_group=0)
    ctx = SPContext(layout=layout, group=None)

    def run() -> None:
        out = model(item["inputs"], ctx, recompute_layers=[0])
        (model.token_losses(out, item["targets"]).sum() / sample.tokens).backward()

    run()
    with LiveBytesTracker() as tracker:
        run()
    return float(tracker.peak_bytes)


@dataclass(frozen=True, slots=True)
class _Timed:
    """One micro-batch of this rank to time: ``run`` on its group (``group`` None for a group of
    one rank) and, for groups of several ranks, ``twin`` on an emulated group."""

    key: str
    run: Callable[[], None]
    group: Any
    ranks: tuple[int, ...]
    twin: Callable[[], None] | None = None


def _timed(run: Callable[[], None], now: Callable[[], float]) -> float:
    start = now()
    run()
    return now() - start


def _time_rounds(items: Sequence[_Timed], *, repeats: int, now: Callable[[], float], rank: int,
                 concurrent: bool, a2a: AllToAllMeter, results: dict[str, Any]) -> None:
    """Time ``items`` the way the profile times its configurations: a warm-up of each, then
    ``repeats`` rounds that run every item once (so a slow minute of a shared machine slows one
    repeat of every item, not every repeat of a few), then one run of each for the peak.

    A group's ranks meet at a barrier before each timed run; the twin runs as the compute
    profile ran (the group's ranks at once, or one at a time). Each rank's items are in plan
    order, so the ranks of a group reach its barriers and all-to-alls in the same order.
    """
    for item in items:
        item.run()
        if item.twin is not None:
            item.twin()
    for item in items:
        results[item.key] = {"times_s": [], "alltoall_times_s": [], "peak_bytes": 0}
        if item.twin is not None:
            results[item.key]["emulated_times_s"] = []
    for _ in range(repeats):
        for item in items:
            rec = results[item.key]
            if item.group is not None:
                dist.barrier(group=item.group)
            inside = a2a.total_s
            rec["times_s"].append(_timed(item.run, now))
            rec["alltoall_times_s"].append(a2a.total_s - inside)
            if item.twin is None:
                continue
            rec["emulated_times_s"].append(run_as_profiled(
                partial(_timed, item.twin, now), rank=rank, ranks=item.ranks,
                concurrent=concurrent, group=item.group))
    for item in items:
        if item.group is not None:
            dist.barrier(group=item.group)
        with LiveBytesTracker() as tracker:
            item.run()
        results[item.key]["peak_bytes"] = tracker.peak_bytes


def execute_rank(rank: int, world: int, config: CheckConfig, plans: Sequence[Plan]) -> dict[str, Any]:
    """Run the plans' micro-batches on this rank of an initialised world of ``world`` gloo ranks
    (every rank calls it): per ``step/micro-batch``, the timed repeats and the peak of live bytes,
    and the calibration micro-batch's peak."""
    results: dict[str, Any] = {}
    registry = GroupRegistry(world_size=world, rank=rank, group_sizes=config.group_sizes)
    executor = Executor(registry=registry, weight_dtype=torch.float64)
    now = time.thread_time if config.clock == "thread" else time.perf_counter
    # The executor's all-to-alls (executor.ulysses calls dist.all_to_all_single) are timed
    # apart, so the report splits each micro-batch into all-to-all and the rest.
    previous = dist.all_to_all_single
    a2a = AllToAllMeter(now).install()  # this spawned rank only
    try:
        model: Any = build_reference_model(config)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # as after the first micro-batch of a step
        results["calibration"] = _calibration_peak(model, config)
        items: list[_Timed] = []
        for plan in plans:
            rank_plan = plan.rank_view(rank)
            executor.begin_step(rank_plan, step=plan.step or 0)
            samples = [ps.sample for mb in rank_plan.group.micro_batches for ps in mb.samples]
            data = SyntheticDataset(samples, kind=config.kind, vocab=config.vocab,
                                    channels=config.model_config.in_channels, seed=config.seed)
            group = registry.group_for(rank_plan.group)
            for m, work in enumerate(executor.micro_batches(rank_plan, load_sample=data.load)):
                def run(work: Any = work) -> None:
                    out = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
                    work.loss(model.token_losses(out, work.targets)).backward()

                def twin(work: Any = work, d: int = rank_plan.group.size) -> None:
                    # the same micro-batch on the emulated group: what the compute profile predicts
                    ctx = SPContext(layout=work.ctx.layout, group=EmulatedGroup(d))
                    out = model(work.inputs, ctx, recompute_layers=work.recompute_layers)
                    work.loss(model.token_losses(out, work.targets)).backward()
                items.append(_Timed(key=f"{plan.step}/{m}", run=run, group=group,
                                    ranks=tuple(rank_plan.group.ranks), twin=None if group is None else twin))
        # Concurrent (a cpu:W cluster's ranks share the machine): every rank times its
        # micro-batches at once, as in training; otherwise groups of several ranks run together
        # and one-rank groups take turns, so that no other rank shares the CPU while they are
        # timed (a GPU rank has its device to itself).
        phases: list[tuple[int | None, list[_Timed]]] = [(None, items)]  # (the rank timing it, or all)
        if not config.concurrent:
            solo = [i for i in items if i.group is None]
            phases = [(None, [i for i in items if i.group is not None]), *((r, solo) for r in range(world))]
        for owner, phase in phases:
            dist.barrier()
            if owner is None or owner == rank:
                _time_rounds(phase, repeats=config.repeats, now=now, rank=rank,
                             concurrent=config.concurrent, a2a=a2a, results=results)
        dist.barrier()
    finally:
        dist.all_to_all_single = previous  # type: ignore[assignment]
    return results


def _exec_worker(rank: int, world: int, port: int, out_dir: str, config_json: str, plans_json: str) -> None:
    with rank_results(rank, world, port, out_dir) as results:
        config = CheckConfig(**json.loads(config_json))
        plans = [Plan.model_validate(p) for p in json.loads(plans_json)]
        results.update(execute_rank(rank, world, config, plans))


def execute(config: CheckConfig, plans: Sequence[Plan]) -> list[dict[str, Any]]:
    """Run the plans on ``world_size`` gloo ranks of their own; per rank, per ``step/micro-batch``:
    the timed repeats and the peak of live bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_exec_worker, args=(config.world_size, free_port(), tmp, json.dumps(asdict(config)),
                                     json.dumps([p.model_dump(mode="json") for p in plans])),
                 nprocs=config.world_size, join=True)
        return read_rank_results(tmp, config.world_size)
