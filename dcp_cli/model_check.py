"""Model vs executor: fit a cost model to the executor's own layers, run real plans, compare.

``run_check`` (behind ``dcp check-model`` and ``bench/model_vs_executor.py``):

1. profiles the executor's reference model and the collectives (``dcp_cli.check_profile``; all
   ranks at once by default, as they share this machine in training);
2. fits a cost model to both (``costmodel.fit``; hardware ``cpu``);
3. plans a few steps of random samples with the planner for a ``cpu:W`` cluster under that
   model (optionally with memory so tight that samples need checkpointing);
4. runs every micro-batch of every plan through the executor on ``W`` gloo ranks: the time of
   forward+backward (slowest rank of the group after a group barrier; the fastest of the
   repeats, as the fit uses; repeats in rounds over all micro-batches, as the profile times its
   configurations, so that a slow spell of a shared machine hits one repeat of each, not every
   repeat of a few) and the peak of live bytes (``LiveBytesTracker``, parameter
   gradients already allocated as in training);
5. compares with ``CostModel.microbatch_time_s`` and ``CostModel.microbatch_peak_bytes`` less
   the model states per micro-batch and per group. The fitted file's ``fixed_working_bytes``
   (what any micro-batch needs whatever its tokens: weight-gradient buffers, loss scratch; the
   fitted per-layer part is folded into it, the depth being fixed) is set from one calibration
   micro-batch of one sample of half the longest size on each rank (its peak less its predicted
   activations), kept out of the comparison.

Clocks: ``wall`` times everything and needs a quiet machine; ``thread`` times the CPU time of
each rank's one torch thread, in the compute profile, the collectives' profile and the executor
alike, which other processes on a busy machine and waits for a peer do not inflate (gloo moves
most of an all-to-all's bytes on its own threads: under ``thread`` the collectives cost what they
cost the compute thread).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.evaluate import CostModel
from costmodel.fit import FitConfig, FitResult, fit_profiles
from costmodel.presets import cpu_cluster
from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.recalibrate import TERMS, TermSplitter
from costmodel.schema import CostModelFile
from costmodel.specs import Sample
from dcp_cli.check_comm import AllToAllMeter, profile_alltoall_in_layer, profile_comm
from dcp_cli.check_config import (
    CheckConfig,
    ProgressFn,
    build_reference_model,
    init_rank,
    reference_spec,
    run_as_profiled,
)
from dcp_cli.check_profile import ReferenceLayer, profile_reference
from dcp_cli.net import free_port
from executor.context import SPContext
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.layout import PackedLayout, SampleShape
from executor.runtime import Executor
from executor.ulysses import EmulatedGroup
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch

__all__ = ["CheckConfig", "ReferenceLayer", "build_reference_model", "compare", "execute", "make_plans",
           "profile_alltoall_in_layer", "profile_comm", "profile_reference", "reference_spec", "run_check"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- plans and execution
def _samples(config: CheckConfig, step: int) -> list[Sample]:
    rng = random.Random(config.seed * 1000 + step)
    out = []
    for i in range(config.samples_per_step):
        tokens = round(config.tokens_min * (config.tokens_max / config.tokens_min) ** rng.random())
        sid = f"s{step}-{i}"
        if config.kind == "1d":
            out.append(Sample(id=sid, tokens=tokens))
        else:
            frames = rng.choice([1, 2, 4, 8])
            side = max(1, round((tokens / frames) ** 0.5))
            out.append(Sample(id=sid, tokens=frames * side * side, frames=frames, height=side, width=side))
    return out


def make_plans(config: CheckConfig, file: CostModelFile) -> list[tuple[Plan, list[Sample]]]:
    """Plans of ``num_steps`` random batches for a ``cpu:W`` cluster under ``file``."""
    cluster = cpu_cluster(config.world_size)
    if config.memory_tokens > 0:
        probe = CostModel(file=file, cluster=cluster)
        need = probe.fixed_bytes() + float(probe.activation_bytes(config.memory_tokens, group_size=1))
        cluster = cpu_cluster(config.world_size, memory_bytes=need / cluster.memory_cap_fraction)
    plans = []
    for step in range(config.num_steps):
        samples = _samples(config, step)
        plan = plan_batch(samples, cluster=cluster, cost_model=file, step=step,
                          config=PlannerConfig.for_budget(0.5))
        plans.append((plan, samples))
    return plans


def _calibration_sample(config: CheckConfig) -> Sample:
    """One sample of half the longest size: its micro-batch's peak less its predicted activations
    is the fixed working memory (on few tokens the peak is the parameter gradients' buffers, not
    activations, so a tiny sample would overstate it)."""
    tokens = max(8, 8 * (config.tokens_max // 16))
    if config.kind == "1d":
        return Sample(id="calibration", tokens=tokens)
    return Sample(id="calibration", tokens=tokens, frames=2, height=4, width=tokens // 8)


def _calibration_peak(model: Any, config: CheckConfig) -> float:
    """Peak live bytes of the calibration micro-batch on one rank."""
    sample = _calibration_sample(config)
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


def _exec_worker(rank: int, world: int, port: int, out_dir: str, config_json: str, plans_json: str) -> None:
    init_rank(rank, world, port)
    results: dict[str, Any] = {}
    try:
        config = CheckConfig(**json.loads(config_json))
        plans = [Plan.model_validate(p) for p in json.loads(plans_json)]
        registry = GroupRegistry(world_size=world, rank=rank, group_sizes=config.group_sizes)
        executor = Executor(registry=registry, weight_dtype=torch.float64)
        now = time.thread_time if config.clock == "thread" else time.perf_counter
        # The executor's all-to-alls (executor.ulysses calls dist.all_to_all_single) are timed
        # apart, so the report splits each micro-batch into all-to-all and the rest.
        a2a = AllToAllMeter(now).install()  # this spawned rank only
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
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def execute(config: CheckConfig, plans: Sequence[Plan]) -> list[dict[str, Any]]:
    """Run the plans on ``world_size`` gloo ranks; per rank, per ``step/micro-batch``: the
    timed repeats and the peak of live bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_exec_worker, args=(config.world_size, free_port(), tmp, json.dumps(asdict(config)),
                                     json.dumps([p.model_dump(mode="json") for p in plans])),
                 nprocs=config.world_size, join=True)
        out = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(config.world_size)]
    for r, res in enumerate(out):
        if "error" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['error']}")
    return out


# ------------------------------------------------------------------- comparison
def compare(file: CostModelFile, config: CheckConfig, plans: Sequence[tuple[Plan, list[Sample]]],
            measured: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Measured vs predicted time and peak bytes per micro-batch and per group."""
    # The fixed working memory of a micro-batch, from the calibration micro-batch of each rank.
    base = CostModel(file=file, cluster=cpu_cluster(config.world_size))
    calibration = _calibration_sample(config)
    calibration_act = float(base.activation_bytes(calibration.tokens, group_size=1))
    fixed_working = max(0.0, max(float(m["calibration"]) for m in measured) - calibration_act)
    # The model's layer count is fixed, so the calibration measures all of the constant part,
    # the layers' fitted working bytes included (they are fitted to tell per-token bytes apart
    # from fixed ones in the profile, whose depths vary).
    file = file.model_copy(update={"activation": file.activation.model_copy(
        update={"fixed_working_bytes": fixed_working, "fixed_working_bytes_per_layer": 0.0})})
    cm = CostModel(file=file, cluster=cpu_cluster(config.world_size))
    splitter = TermSplitter(cm)
    rows: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    for plan, _ in plans:
        for gi, group in enumerate(plan.groups):
            group_meas, group_pred = 0.0, 0.0
            for m, mb in enumerate(group.micro_batches):
                samples = [ps.sample for ps in mb.samples]
                ks = [ps.recompute_layers for ps in mb.samples]
                per_rank = [measured[r][f"{plan.step}/{m}"] for r in group.ranks]
                # slowest rank of each repeat, then the fastest repeat (and its all-to-all part)
                reps = [max((x["times_s"][i], x["alltoall_times_s"][i]) for x in per_rank)
                        for i in range(len(per_rank[0]["times_s"]))]
                time_s, alltoall_s = min(reps)
                twins = [x["emulated_times_s"] for x in per_rank if "emulated_times_s" in x]
                emulated_s = max(min(t) for t in twins) if twins else None
                terms = splitter(samples, group_size=group.size, recompute_layers=ks)
                peak = max(x["peak_bytes"] for x in per_rank)
                pred_t = cm.microbatch_time_s(samples, group_size=group.size, recompute_layers=ks)
                pred_b = cm.microbatch_peak_bytes(samples, group_size=group.size,
                                                  recompute_layers=ks) - cm.model_state_bytes()
                rows.append({"step": plan.step, "group": gi, "micro_batch": m, "group_size": group.size,
                             "tokens": sum(s.tokens for s in samples), "num_samples": len(samples),
                             "policies": ks, "time_s": time_s, "predicted_time_s": pred_t,
                             "alltoall_s": alltoall_s, "emulated_time_s": emulated_s,
                             "predicted_alltoall_s": float(terms[TERMS.index("alltoall")]),
                             "peak_bytes": peak, "predicted_peak_bytes": pred_b})
                group_meas += time_s
                group_pred += pred_t
            if group.micro_batches:
                groups.append({"step": plan.step, "group": gi, "group_size": group.size,
                               "time_s": group_meas, "predicted_time_s": group_pred})

    def err(a: float, b: float) -> float:
        return abs(b - a) / a

    summary = {
        "micro_batches": len(rows),
        "time_mape": statistics.fmean(err(r["time_s"], r["predicted_time_s"]) for r in rows),
        "time_bias": statistics.fmean(r["predicted_time_s"] / r["time_s"] - 1 for r in rows),
        "group_time_mape": statistics.fmean(err(g["time_s"], g["predicted_time_s"]) for g in groups),
        "peak_mape": statistics.fmean(err(r["peak_bytes"], r["predicted_peak_bytes"]) for r in rows),
        "peak_max_error": max(err(r["peak_bytes"], r["predicted_peak_bytes"]) for r in rows),
        "mixed_policy_micro_batches": sum(1 for r in rows if len(set(r["policies"])) > 1),
        "checkpointed_micro_batches": sum(1 for r in rows if max(r["policies"]) > 0),
        "fixed_working_bytes": fixed_working,
        "by_group_size": {
            str(d): {"micro_batches": len(sel),
                     "time_mape": statistics.fmean(err(r["time_s"], r["predicted_time_s"]) for r in sel),
                     "time_bias": statistics.fmean(r["predicted_time_s"] / r["time_s"] - 1 for r in sel),
                     "peak_mape": statistics.fmean(err(r["peak_bytes"], r["predicted_peak_bytes"]) for r in sel),
                     # where a group's time goes: inside the all-to-alls and the rest
                     "alltoall_s": sum(r["alltoall_s"] for r in sel),
                     "predicted_alltoall_s": sum(r["predicted_alltoall_s"] for r in sel),
                     "time_s_sum": sum(r["time_s"] for r in sel),
                     "rest_s": sum(r["time_s"] - r["alltoall_s"] for r in sel),
                     # the same micro-batches on the emulated group (d > 1): the compute model's
                     # own error (vs predicted rest) and what the all-to-alls add (time minus it)
                     "emulated_s": (sum(r["emulated_time_s"] for r in sel)
                                    if all(r["emulated_time_s"] is not None for r in sel) else None),
                     "predicted_rest_s": sum(r["predicted_time_s"] - r["predicted_alltoall_s"]
                                             for r in sel)}
            for d in sorted({r["group_size"] for r in rows})
            for sel in [[r for r in rows if r["group_size"] == d]]},
        "by_policy": {
            name: {"micro_batches": len(sel),
                   "peak_mape": statistics.fmean(err(r["peak_bytes"], r["predicted_peak_bytes"]) for r in sel)}
            for name, sel in (("none", [r for r in rows if max(r["policies"]) == 0]),
                              ("checkpointed", [r for r in rows if max(r["policies"]) > 0])) if sel},
    }
    return {"summary": summary, "micro_batches": rows, "groups": groups}


def run_check(config: CheckConfig, *, progress: ProgressFn | None = None,
              cost_model: CostModelFile | None = None) -> dict[str, Any]:
    """Fit (unless ``cost_model`` is given), plan, execute, compare; the report as a dict."""
    fit: FitResult | None = None
    if cost_model is None:
        compute = profile_reference(config, progress=progress)
        if progress:
            progress(f"profiling collectives on {config.world_size} gloo ranks")
        comm = profile_comm(config.world_size, clock=config.clock)
        if progress:
            progress("profiling the all-to-all inside the layers (real group vs local copy)")
        in_layer = profile_alltoall_in_layer(config)
        fit = fit_profiles([compute, comm, in_layer], FitConfig(force=True, time_statistic="min",
                                                      comm_fallback_hardware="h200-sxm"))
        cost_model = fit.file
    if progress:
        progress("planning")
    plans = make_plans(config, cost_model)
    if progress:
        progress(f"running {sum(len(g.micro_batches) for p, _ in plans for g in p.groups)} micro-batches "
                 f"on {config.world_size} gloo ranks")
    measured = execute(config, [p for p, _ in plans])
    report = compare(cost_model, config, plans, measured)
    report["config"] = asdict(config)
    report["cost_model"] = {"id": cost_model.id, "fit_quality": {
        k: v.model_dump() for k, v in cost_model.fit_quality.items()}, "notes": cost_model.notes}
    return report
