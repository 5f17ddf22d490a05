"""Collectives for ``dcp check-model``: back to back (``profile-comm``) and as the layers expose them.

Back to back, an all-to-all on gloo costs what ``dcp profile-comm`` measures. Inside a layer it
costs more: each call wakes gloo's threads and the peer, and the compute around it then runs on
cold caches (on this 2-core box the real rank of a 2-rank group computes 5-12% longer than the
same rank with the all-to-all replaced by a local copy). :func:`profile_alltoall_in_layer`
measures that: the reference model's forward+backward on the real group minus the same on an
``EmulatedGroup`` (run as the compute profile runs: ranks at once, or one at a time), per call,
as ``in_layer`` comm records that the fit prefers for its group size.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from costmodel.presets import CPU_HARDWARE
from costmodel.profiling.comm import CommSweepConfig, run_comm_sweep
from costmodel.profiling.format import CommRecord, Profile, ProfileHeader
from dcp_cli.check_config import CheckConfig, build_reference_model, init_rank, run_as_profiled
from dcp_cli.net import free_port
from executor.context import SPContext
from executor.layout import PackedLayout, SampleShape
from executor.ulysses import EmulatedGroup, Group

logger = logging.getLogger(__name__)

__all__ = ["AllToAllMeter", "comm_profile", "comm_records", "in_layer_profile", "in_layer_rows", "in_layer_shapes",
           "profile_alltoall_in_layer", "profile_comm"]


class AllToAllMeter:
    """Stands in for ``dist.all_to_all_single`` in a rank: calls, input bytes and time inside."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.total_s, self.calls, self.bytes = 0.0, 0, 0
        self._inner = dist.all_to_all_single

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        start = self.now()
        try:
            return self._inner(output, input, *args, **kwargs)
        finally:
            self.total_s += self.now() - start
            self.calls += 1
            self.bytes += input.numel() * input.element_size()

    def install(self) -> AllToAllMeter:
        """Route this process's ``dist.all_to_all_single`` (the executor's calls) through the meter."""
        dist.all_to_all_single = self  # type: ignore[assignment]
        return self


def comm_records(world: int, *, clock: str) -> list[CommRecord]:
    """The collectives' sweep on this rank of an initialised world of ``world`` gloo ranks (every
    rank calls it; rank 0's records are the profile's)."""
    config = CommSweepConfig(bytes_min=4 * 1024, bytes_max=2 * 1024 * 1024, num_sizes=6,
                             gpus_per_node=world, warmup=3, repeats=15,
                             clock=clock)  # type: ignore[arg-type]
    return run_comm_sweep(config, device=torch.device("cpu"))


def _comm_worker(rank: int, world: int, port: int, out: str, clock: str) -> None:
    init_rank(rank, world, port)
    try:
        records = comm_records(world, clock=clock)
        if rank == 0:
            Path(out).write_text(json.dumps([r.model_dump(mode="json") for r in records]))
    finally:
        dist.destroy_process_group()


def comm_profile(world: int, records: Sequence[CommRecord]) -> Profile:
    """The collectives' profile of ``records`` (rank 0's)."""
    header = ProfileHeader(hardware=CPU_HARDWARE, device="cpu", dtype="float32", world_size=world,
                           notes="dcp check-model: gloo on loopback")
    return Profile(header=header, comm=list(records))


def profile_comm(world: int, *, clock: str = "wall") -> Profile:
    """All-to-all and all-reduce on ``world`` gloo ranks of this machine (timed by ``clock``), in
    processes of their own."""
    if world < 2:
        return comm_profile(world, [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        mp.spawn(_comm_worker, args=(world, free_port(), str(out), clock), nprocs=world, join=True)
        comm = [CommRecord.model_validate(r) for r in json.loads(out.read_text())]
    return comm_profile(world, comm)


def in_layer_shapes(config: CheckConfig, group_size: int, *, num_sizes: int = 6) -> list[list[tuple[int, int]]]:
    """Micro-batches (``[frames, tokens_per_frame]`` per sample) spanning the check's sizes.

    Totals run geometrically from ``max(tokens_min, 4 * group_size)`` to ``2 * tokens_max``; 1D
    alternates one sample and two packed ones, 2D cycles through 1, 2, 4 and 8 frames.
    """
    low = max(config.tokens_min, 4 * group_size)
    totals = np.unique(np.geomspace(low, max(low, 2 * config.tokens_max), num_sizes).round().astype(int))
    shapes: list[list[tuple[int, int]]] = []
    for i, total in enumerate(int(t) for t in totals):
        if config.kind == "1d":
            half = total // 2
            shapes.append([(1, total)] if i % 2 == 0 or half < group_size
                          else [(1, half), (1, total - half)])
        else:
            frames = (1, 2, 4, 8)[i % 4]
            shapes.append([(frames, max(1, total // frames))])
    return shapes


def _group_time_s(times: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's time (``times[rank][repeat]``)."""
    return [max(rank_times[i] for rank_times in times) for i in range(len(times[0]))]


def _time_step(model: torch.nn.Module, layout: PackedLayout, inputs: torch.Tensor, targets: torch.Tensor,
               group: Group, now: Callable[[], float]) -> float:
    """Forward+backward of the whole reference model on this rank's tokens (no checkpointing)."""
    m: Any = model
    start = now()
    out = m(inputs, SPContext(layout=layout, group=group), recompute_layers=[0] * layout.num_samples)
    m.token_losses(out, targets).sum().backward()
    return now() - start


def _rank_inputs(config: CheckConfig, local_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if config.kind == "1d":
        ids = torch.randint(0, config.vocab, (local_tokens,), generator=gen)
        return ids, torch.randint(0, config.vocab, (local_tokens,), generator=gen)
    channels = config.model_config.in_channels
    return (torch.randn(local_tokens, channels, generator=gen),
            torch.randn(local_tokens, channels, generator=gen))


def in_layer_rows(config: CheckConfig, rank: int, world: int) -> list[Any]:
    """Real group vs emulated group on this rank of an initialised world of ``world`` gloo ranks
    (every rank calls it); every rank's rows, gathered on every rank."""
    now = time.thread_time if config.clock == "thread" else time.perf_counter
    meter = AllToAllMeter(now)
    previous = dist.all_to_all_single
    meter.install()
    try:
        model = build_reference_model(config)
        repeats = max(3, 3 * config.sweep_repeats)
        gen = torch.Generator().manual_seed(config.seed + rank)
        rows: list[dict[str, Any]] = []
        for d in (d for d in config.group_sizes if d > 1 and world % d == 0):
            blocks = [dist.new_group(list(range(s, s + d))) for s in range(0, world, d)]
            for shape in in_layer_shapes(config, d):
                layout = PackedLayout(samples=tuple(SampleShape(tokens=f * hw, frames=f) for f, hw in shape),
                                      group_size=d, index_in_group=rank % d)
                inputs, targets = _rank_inputs(config, layout.local_tokens, gen)
                real_s: list[float] = []
                emulated_s: list[float] = []
                calls, sent = 0, 0
                for rep in range(repeats + 1):  # the first is a warm-up
                    dist.barrier()
                    c0, b0 = meter.calls, meter.bytes
                    real = _time_step(model, layout, inputs, targets, blocks[rank // d], now)
                    calls, sent = meter.calls - c0, meter.bytes - b0
                    # emulated as the compute profile ran: every rank at once, or one at a time
                    emulated = run_as_profiled(
                        partial(_time_step, model, layout, inputs, targets, EmulatedGroup(d), now),
                        rank=rank, ranks=range(world), concurrent=config.concurrent)
                    if rep:
                        real_s.append(real)
                        emulated_s.append(emulated)
                rows.append({"group_size": d, "shape": shape, "real_s": real_s, "emulated_s": emulated_s,
                             "calls": calls, "bytes": sent})
    finally:
        dist.all_to_all_single = previous  # type: ignore[assignment]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    return gathered


def _in_layer_worker(rank: int, world: int, port: int, out: str, config_json: str) -> None:
    init_rank(rank, world, port)
    try:
        gathered = in_layer_rows(CheckConfig(**json.loads(config_json)), rank, world)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def _records(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[CommRecord]:
    """One ``in_layer`` record per group size and shape, from the first block of ranks."""
    records: list[CommRecord] = []
    for i, row in enumerate(per_rank[0]):
        d = int(row["group_size"])
        ranks = [rows[i] for rows in per_rank[:d]]  # block 0: ranks 0..d-1
        real = _group_time_s([r["real_s"] for r in ranks])
        emulated = _group_time_s([r["emulated_s"] for r in ranks])
        calls = int(row["calls"])
        if calls == 0:
            raise RuntimeError(f"no all-to-all call in the layers at group size {d}: the executor's "
                               "all-to-alls did not go through dist.all_to_all_single")
        # fastest against fastest: the statistic the compute profile's fastest-repeat fit pairs with
        per_call_s = (min(real) - min(emulated)) / calls
        if per_call_s <= 0:
            logger.warning("in-layer all-to-all at group size %d, shape %s: the fastest real run (%.4g s) "
                           "is not slower than the fastest emulated one (%.4g s); left out",
                           d, row["shape"], min(real), min(emulated))
            continue
        bytes_per_call = statistics.fmean(float(r["bytes"]) for r in ranks) / calls
        records.append(CommRecord(op="alltoall", group_size=d, num_nodes=1, bytes_per_rank=bytes_per_call,
                                  backend="gloo", context="in_layer", time_s=per_call_s,
                                  time_s_min=per_call_s, time_s_max=per_call_s, num_repeats=len(real)))
    return records


def in_layer_profile(config: CheckConfig, per_rank: Sequence[Sequence[dict[str, Any]]]) -> Profile:
    """The ``in_layer`` comm profile of every rank's rows (:func:`in_layer_rows`).

    Raises:
        RuntimeError: When no shape gave a positive difference (a machine too noisy to tell).
    """
    header = ProfileHeader(hardware=CPU_HARDWARE, device="cpu", dtype="float32",
                           world_size=config.world_size,
                           notes="dcp check-model: all-to-all inside the reference layers, gloo on loopback")
    if config.world_size < 2:
        return Profile(header=header)
    records = _records(per_rank)
    if not records:
        raise RuntimeError("no in-layer all-to-all measurement came out positive: the machine is too "
                           "busy to tell the all-to-all from the compute")
    return Profile(header=header, comm=records)


def profile_alltoall_in_layer(config: CheckConfig) -> Profile:
    """What an all-to-all adds inside the reference model's layers on ``config.world_size`` gloo
    ranks, per call (``in_layer`` comm records; none for a world of one), in processes of their own.

    Raises:
        RuntimeError: When no shape gave a positive difference (a machine too noisy to tell).
    """
    if config.world_size < 2:
        return in_layer_profile(config, [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "in_layer.json"
        mp.spawn(_in_layer_worker, args=(config.world_size, free_port(), str(out), json.dumps(asdict(config))),
                 nprocs=config.world_size, join=True)
        return in_layer_profile(config, json.loads(out.read_text()))
