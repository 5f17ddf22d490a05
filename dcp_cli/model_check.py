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

Steps 1-4 run in one world of ``W`` spawned gloo ranks (rank 0 fits and plans and broadcasts the
plans; ``dcp_cli.check_exec`` runs them): starting a world of ranks that import torch costs
seconds on a small machine, once instead of four times. With ``cost_model`` given, only steps
3-5 run.

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
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.evaluate import CostModel
from costmodel.fit import FitConfig, fit_profiles
from costmodel.presets import cpu_cluster
from costmodel.profiling.format import Profile
from costmodel.recalibrate import TERMS, TermSplitter
from costmodel.schema import CostModelFile
from costmodel.specs import Sample
from dcp_cli.check_comm import (
    comm_profile,
    comm_records,
    in_layer_profile,
    in_layer_rows,
    profile_alltoall_in_layer,
    profile_comm,
)
from dcp_cli.check_config import (
    CheckConfig,
    ProgressFn,
    build_reference_model,
    rank_results,
    read_rank_results,
    reference_spec,
)
from dcp_cli.check_exec import calibration_sample, execute, execute_rank
from dcp_cli.check_profile import ReferenceLayer, compute_profile, profile_reference, sweep_message, sweep_records
from dcp_cli.net import free_port
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch

__all__ = ["CheckConfig", "ReferenceLayer", "build_reference_model", "compare", "execute", "fit_check_profiles",
           "make_plans", "profile_alltoall_in_layer", "profile_comm", "profile_reference", "reference_spec",
           "run_check"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- plans
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


# ------------------------------------------------------------------- comparison
def compare(file: CostModelFile, config: CheckConfig, plans: Sequence[tuple[Plan, list[Sample]]],
            measured: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Measured vs predicted time and peak bytes per micro-batch and per group."""
    # The fixed working memory of a micro-batch, from the calibration micro-batch of each rank.
    base = CostModel(file=file, cluster=cpu_cluster(config.world_size))
    calibration = calibration_sample(config)
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


def fit_check_profiles(profiles: Sequence[Profile]) -> CostModelFile:
    """The cost model the check fits to its compute, collectives and in-layer profiles."""
    fit = fit_profiles(list(profiles), FitConfig(force=True, time_statistic="min",
                                                comm_fallback_hardware="h200-sxm"))
    return fit.file


def _running_message(config: CheckConfig, plans: Sequence[Plan]) -> str:
    return (f"running {sum(len(g.micro_batches) for p in plans for g in p.groups)} micro-batches "
            f"on {config.world_size} gloo ranks")


def _check_rank(rank: int, world: int, config: CheckConfig, say: ProgressFn) -> tuple[dict[str, Any], Any]:
    """Profile, fit and plan (rank 0; the plans are broadcast), execute: one rank's part of the check.
    Returns this rank's measurements and, on rank 0, the fitted file and plans as JSON."""
    say(sweep_message(config))
    records = sweep_records(config) if config.concurrent or rank == 0 else []
    dist.barrier()  # one at a time: the other ranks wait while rank 0 sweeps alone
    comm: list[Any] = []
    gathered: list[Any] = []
    if world > 1:
        say(f"profiling collectives on {world} gloo ranks")
        comm = comm_records(world, clock=config.clock)
        say("profiling the all-to-all inside the layers (real group vs local copy)")
        gathered = in_layer_rows(config, rank, world)
    payload: list[Any] = [None]
    if rank == 0:
        try:
            file = fit_check_profiles([compute_profile(config, records), comm_profile(world, comm),
                                       in_layer_profile(config, gathered)])
            say("planning")
            plans = [p for p, _ in make_plans(config, file)]
            payload = [{"file": file.model_dump(mode="json"), "plans": [p.model_dump(mode="json") for p in plans]}]
        except Exception:
            payload = [{"error": traceback.format_exc()}]
    dist.broadcast_object_list(payload, src=0)
    if "error" in payload[0]:
        raise RuntimeError("rank 0 failed to fit or plan" if rank else payload[0]["error"])
    plans = [Plan.model_validate(p) for p in payload[0]["plans"]]
    say(_running_message(config, plans))
    return execute_rank(rank, world, config, plans), payload[0] if rank == 0 else None


def _parent_logging() -> tuple[int, str | None]:
    """The level and format of this process's logging (``dcp``'s, under the CLI), for rank 0."""
    root = logging.getLogger()
    formatter = root.handlers[0].formatter if root.handlers else None
    return root.level, None if formatter is None else formatter._fmt


def _check_worker(rank: int, world: int, port: int, out_dir: str, config_json: str, messages: Any,
                  log: tuple[int, str | None]) -> None:
    """One rank of the check's one world: every phase in the same processes (a world of ranks
    costs seconds to start on a small machine). Rank 0 logs as the parent does: the fit's and the
    in-layer profile's warnings, which the parent logged when it fitted."""
    level, fmt = log
    if rank == 0 and fmt is not None:
        logging.basicConfig(level=level, format=fmt)
    with rank_results(rank, world, port, out_dir) as results:
        say: ProgressFn = messages.put if rank == 0 else (lambda text: None)
        measured, fitted = _check_rank(rank, world, CheckConfig(**json.loads(config_json)), say)
        results.update(measured)
        if fitted is not None:
            (Path(out_dir) / "fitted.json").write_text(json.dumps(fitted))


def _fit_and_execute(config: CheckConfig, progress: ProgressFn | None
                     ) -> tuple[CostModelFile, list[Plan], list[dict[str, Any]]]:
    """Profile, fit, plan and execute in one spawned world of ``world_size`` ranks."""
    messages = mp.get_context("spawn").SimpleQueue()

    def drain() -> None:
        while not messages.empty():
            text = messages.get()
            if progress:
                progress(text)

    with tempfile.TemporaryDirectory() as tmp:
        ranks = mp.spawn(_check_worker, args=(config.world_size, free_port(), tmp, json.dumps(asdict(config)),
                                              messages, _parent_logging()),
                         nprocs=config.world_size, join=False)
        try:
            while not ranks.join(timeout=0.2):
                drain()
        finally:
            drain()
        out = read_rank_results(tmp, config.world_size)
        fitted = json.loads((Path(tmp) / "fitted.json").read_text())
    return (CostModelFile.model_validate(fitted["file"]), [Plan.model_validate(p) for p in fitted["plans"]], out)


def run_check(config: CheckConfig, *, progress: ProgressFn | None = None,
              cost_model: CostModelFile | None = None) -> dict[str, Any]:
    """Fit (unless ``cost_model`` is given), plan, execute, compare; the report as a dict.

    Without ``cost_model`` every phase runs in one world of ``world_size`` spawned ranks (rank 0
    fits and plans between the profiles and the execution)."""
    if cost_model is None:
        cost_model, plan_list, measured = _fit_and_execute(config, progress)
        plans = [(plan, _samples(config, step)) for step, plan in enumerate(plan_list)]  # as make_plans
    else:
        if progress:
            progress("planning")
        plans = make_plans(config, cost_model)
        if progress:
            progress(_running_message(config, [p for p, _ in plans]))
        measured = execute(config, [p for p, _ in plans])
    report = compare(cost_model, config, plans, measured)
    report["config"] = asdict(config)
    report["cost_model"] = {"id": cost_model.id, "fit_quality": {
        k: v.model_dump() for k, v in cost_model.fit_quality.items()}, "notes": cost_model.notes}
    return report
