"""Model vs executor: fit a cost model to the executor's own layers, run real plans, compare.

``run_check`` (behind ``dcp check-model`` and ``bench/model_vs_executor.py``):

1. profiles the executor's reference model (``executor.models``) with the profiling sweep, each
   layer called as one rank of a group (``executor.ulysses.EmulatedGroup``: the all-to-all is a
   local copy), and the collectives with ``dcp profile-comm``'s sweep on a gloo world;
2. fits a cost model to both (``costmodel.fit``; hardware ``cpu``);
3. plans a few steps of random samples with the planner for a ``cpu:W`` cluster under that
   model (optionally with memory so tight that samples need checkpointing);
4. runs every micro-batch of every plan through the executor on ``W`` gloo ranks: the time of
   forward+backward (slowest rank of the group after a group barrier; the fastest of the
   repeats, as the fit uses) and the peak of live bytes (``LiveBytesTracker``, parameter
   gradients already allocated as in training);
5. compares with ``CostModel.microbatch_time_s`` and ``CostModel.microbatch_peak_bytes`` less
   the model states per micro-batch and per group. The fitted file's ``fixed_working_bytes``
   (what any micro-batch needs: parameter-gradient buffers, loss scratch) is set from one
   calibration micro-batch of one sample of half the longest size on each rank (its peak less its
   predicted activations), kept out of the comparison.

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
import socket
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from costmodel.evaluate import CostModel
from costmodel.fit import FitConfig, FitResult, fit_profiles
from costmodel.presets import CPU_HARDWARE, cpu_cluster
from costmodel.profiling.comm import CommSweepConfig, run_comm_sweep
from costmodel.profiling.format import CommRecord, ComputeRecord, HeadRecord, Profile, ProfileHeader
from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.profiling.sweep import SweepConfig, make_header, run_sweep
from costmodel.schema import CostModelFile
from costmodel.specs import ModelSpec, Sample
from executor.context import SPContext
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.layout import PackedLayout, SampleShape
from executor.models import Llama1D, ModelConfig, STDiT2D, init_weights
from executor.runtime import Executor
from executor.ulysses import EmulatedGroup
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckConfig:
    """What the check runs."""

    kind: Literal["1d", "2d"] = "1d"
    """Reference model: LLaMA-style 1D or STDiT-style 2D."""
    world_size: int = 2
    """gloo ranks (one thread each; a 2-core machine runs 2 well)."""
    num_layers: int = 4
    """Layers of the reference model."""
    hidden: int = 64
    """Hidden size."""
    num_heads: int = 4
    """Attention heads (the group sizes must divide it)."""
    ffn_hidden: int = 128
    """MLP size."""
    vocab: int = 256
    """Vocabulary (1D)."""
    num_steps: int = 3
    """Planned steps to run."""
    samples_per_step: int = 8
    """Samples per step."""
    tokens_min: int = 32
    """Shortest sample in tokens."""
    tokens_max: int = 1024
    """Longest sample in tokens."""
    memory_tokens: int = 600
    """If positive: memory per rank such that about this many tokens fit without checkpointing
    (plans then mix policies); 0 leaves memory roomy."""
    sweep_repeats: int = 5
    """Timed repeats per profiled point."""
    repeats: int = 5
    """Timed repeats per executed micro-batch."""
    seed: int = 0
    """Seed of samples, weights and data."""
    clock: Literal["wall", "thread"] = "thread"
    """``thread``: CPU time of the rank's thread (robust on a busy machine, all-to-all excluded);
    ``wall``: elapsed time (everything; needs a quiet machine)."""

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "thread"):
            raise ValueError(f"clock must be wall or thread, got {self.clock!r}")
        if self.world_size < 1 or (self.world_size > 1 and self.num_heads % self.world_size):
            raise ValueError(f"world_size={self.world_size} must be positive and divide num_heads="
                             f"{self.num_heads}")
        if not 0 < self.tokens_min <= self.tokens_max:
            raise ValueError(f"need 0 < tokens_min <= tokens_max, got {self.tokens_min}, {self.tokens_max}")
        for name in ("num_layers", "hidden", "num_heads", "ffn_hidden", "num_steps", "samples_per_step",
                     "sweep_repeats", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def model_config(self) -> ModelConfig:
        """The executor's reference-model configuration."""
        return ModelConfig(num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads,
                           ffn_hidden=self.ffn_hidden, vocab=self.vocab)

    @property
    def group_sizes(self) -> list[int]:
        """Group sizes plans may use: divisors of the heads up to the world."""
        return [d for d in range(1, self.world_size + 1) if self.num_heads % d == 0]


def reference_spec(config: CheckConfig) -> ModelSpec:
    """The model spec of the reference model (what the cost model is for)."""
    return ModelSpec(name=f"ref-{config.kind}-h{config.hidden}-l{config.num_layers}", kind=config.kind,
                     num_layers=config.num_layers, hidden=config.hidden, num_heads=config.num_heads,
                     ffn_hidden=config.ffn_hidden, vocab=config.vocab if config.kind == "1d" else 0,
                     causal=config.kind == "1d", mlp="swiglu" if config.kind == "1d" else "gelu")


def build_reference_model(config: CheckConfig) -> nn.Module:
    """The executor's reference model, deterministically initialised (fp32)."""
    cfg = config.model_config
    model: nn.Module = Llama1D(cfg) if config.kind == "1d" else STDiT2D(cfg)
    init_weights(model, seed=config.seed)
    return model


# ------------------------------------------------------------------- profiling the executor's layers
class ReferenceLayer(nn.Module):
    """An executor layer called as the profiling sweep calls its layers (one rank of a group)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, samples: Sequence[tuple[int, int]], *rest: Any) -> torch.Tensor:
        """``rest`` ends with the group size (2D extras before it are not used by this model)."""
        group_size = int(rest[-1]) if rest else 1
        layout = PackedLayout(samples=tuple(SampleShape(tokens=f * hw, frames=f) for f, hw in samples),
                              group_size=group_size, index_in_group=0)
        ctx = SPContext(layout=layout, group=EmulatedGroup(group_size) if group_size > 1 else None)
        out: torch.Tensor = self.layer(x, ctx)
        return out


class ReferenceHead(nn.Module):
    """What surrounds the layers of the reference model, with its loss (the sweep's head)."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """1D: token ids -> cross-entropy; 2D: patches (first ``in_channels`` channels) -> MSE."""
        m: Any = self.model
        if self.kind == "1d":
            logits = m.head(m.norm(m.embed(inputs)))
            return nn.functional.cross_entropy(logits, inputs.roll(-1))
        patches = inputs[:, : m.config.in_channels]
        out = m.head(m.norm(m.embed(patches)))
        return nn.functional.mse_loss(out, patches)


def _layer_factory(config: CheckConfig) -> Callable[..., nn.ModuleList]:
    def build(spec: ModelSpec, num_layers: int, *, device: torch.device, dtype: torch.dtype) -> nn.ModuleList:
        model = build_reference_model(config).to(device=device, dtype=dtype)
        layers = list(model.layers)[:num_layers]  # type: ignore[arg-type]
        return nn.ModuleList(ReferenceLayer(layer) for layer in layers)
    return build


def _head_factory(config: CheckConfig) -> Callable[..., nn.Module]:
    def build(spec: ModelSpec, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return ReferenceHead(build_reference_model(config).to(device=device, dtype=dtype), config.kind)
    return build


def profile_reference(config: CheckConfig, *, progress: ProgressFn | None = None) -> Profile:
    """Compute and head profile of the reference model on this CPU (one torch thread)."""
    spec = reference_spec(config)
    sweep = SweepConfig(tokens_min=config.tokens_min, tokens_max=config.tokens_max, num_sizes=6,
                        packings=(2, 4), num_packed=3, frames=(1, 2, 4, 8),
                        layer_counts=tuple(sorted({1, 2, config.num_layers})),
                        num_head_sizes=5, warmup=2, repeats=config.sweep_repeats, seed=config.seed,
                        cpu_clock=config.clock, group_sizes=tuple(config.group_sizes))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if progress:
            progress(f"profiling the executor's {config.kind} layers")
        records = run_sweep(spec, sweep, device=torch.device("cpu"), dtype="float32",
                            layer_factory=_layer_factory(config), head_factory=_head_factory(config))
    finally:
        torch.set_num_threads(threads)
    header = make_header(model=spec, profiled=spec, hardware=CPU_HARDWARE, device=torch.device("cpu"),
                         dtype="float32", notes="dcp check-model: the executor's reference layers",
                         cpu_clock=config.clock)
    return Profile(header=header, compute=[r for r in records if isinstance(r, ComputeRecord)],
                   head=[r for r in records if isinstance(r, HeadRecord)])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _comm_worker(rank: int, world: int, port: int, out: str, clock: str) -> None:
    _init(rank, world, port)
    try:
        config = CommSweepConfig(bytes_min=4 * 1024, bytes_max=2 * 1024 * 1024, num_sizes=6,
                                 gpus_per_node=world, warmup=3, repeats=15,
                                 clock=clock)  # type: ignore[arg-type]
        records = run_comm_sweep(config, device=torch.device("cpu"))
        if rank == 0:
            Path(out).write_text(json.dumps([r.model_dump(mode="json") for r in records]))
    finally:
        dist.destroy_process_group()


def profile_comm(world: int, *, clock: str = "wall") -> Profile:
    """All-to-all and all-reduce on ``world`` gloo ranks of this machine (timed by ``clock``)."""
    header = ProfileHeader(hardware=CPU_HARDWARE, device="cpu", dtype="float32", world_size=world,
                           notes="dcp check-model: gloo on loopback")
    if world < 2:
        return Profile(header=header)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        mp.spawn(_comm_worker, args=(world, _free_port(), str(out), clock), nprocs=world, join=True)
        comm = [CommRecord.model_validate(r) for r in json.loads(out.read_text())]
    return Profile(header=header, comm=comm)


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


def _measure(run: Callable[[], None], *, repeats: int, now: Callable[[], float],
             group: Any) -> dict[str, Any]:
    """Warm-up, ``repeats`` timed runs (after a group barrier), then one run for the peak."""
    run()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        start = now()
        run()
        times.append(now() - start)
    if group is not None:
        dist.barrier(group=group)
    with LiveBytesTracker() as tracker:
        run()
    return {"times_s": times, "peak_bytes": tracker.peak_bytes}


def _exec_worker(rank: int, world: int, port: int, out_dir: str, config_json: str, plans_json: str) -> None:
    _init(rank, world, port)
    results: dict[str, Any] = {}
    try:
        config = CheckConfig(**json.loads(config_json))
        plans = [Plan.model_validate(p) for p in json.loads(plans_json)]
        registry = GroupRegistry(world_size=world, rank=rank, group_sizes=config.group_sizes)
        executor = Executor(registry=registry, weight_dtype=torch.float64)
        now = time.thread_time if config.clock == "thread" else time.perf_counter
        model: Any = build_reference_model(config)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # as after the first micro-batch of a step
        results["calibration"] = _calibration_peak(model, config)
        solo: list[tuple[str, Callable[[], None]]] = []  # micro-batches of one-rank groups
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
                key = f"{plan.step}/{m}"
                if group is None:
                    solo.append((key, run))
                    continue
                results[key] = _measure(run, repeats=config.repeats, now=now, group=group)
        # One-rank groups take turns, so that no other rank shares the CPU while they are timed
        # (a GPU rank has its device to itself); groups of several ranks run together.
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                for key, solo_run in solo:
                    results[key] = _measure(solo_run, repeats=config.repeats, now=now, group=None)
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
        mp.spawn(_exec_worker, args=(config.world_size, _free_port(), tmp, json.dumps(asdict(config)),
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
    file = file.model_copy(update={"activation": file.activation.model_copy(
        update={"fixed_working_bytes": fixed_working})})
    cm = CostModel(file=file, cluster=cpu_cluster(config.world_size))
    rows: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    for plan, _ in plans:
        for gi, group in enumerate(plan.groups):
            group_meas, group_pred = 0.0, 0.0
            for m, mb in enumerate(group.micro_batches):
                samples = [ps.sample for ps in mb.samples]
                ks = [ps.recompute_layers for ps in mb.samples]
                per_rank = [measured[r][f"{plan.step}/{m}"] for r in group.ranks]
                # slowest rank of each repeat, then the fastest repeat
                time_s = min(max(rep) for rep in zip(*(x["times_s"] for x in per_rank), strict=True))
                peak = max(x["peak_bytes"] for x in per_rank)
                pred_t = cm.microbatch_time_s(samples, group_size=group.size, recompute_layers=ks)
                pred_b = cm.microbatch_peak_bytes(samples, group_size=group.size,
                                                  recompute_layers=ks) - cm.model_state_bytes()
                rows.append({"step": plan.step, "group": gi, "micro_batch": m, "group_size": group.size,
                             "tokens": sum(s.tokens for s in samples), "num_samples": len(samples),
                             "policies": ks, "time_s": time_s, "predicted_time_s": pred_t,
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
                     "peak_mape": statistics.fmean(err(r["peak_bytes"], r["predicted_peak_bytes"]) for r in sel)}
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
        fit = fit_profiles([compute, comm], FitConfig(force=True, time_statistic="min",
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
