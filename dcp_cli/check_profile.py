"""Compute profile for ``dcp check-model``: the executor's own layers on this machine.

The layers are profiled with the profiling sweep (``costmodel.profiling.sweep``), each called as
one rank of a group (``executor.ulysses.EmulatedGroup``: the all-to-all is a local copy); the
collectives are profiled by :mod:`dcp_cli.check_comm`.

With ``CheckConfig.concurrent`` (the default) every one of the ``world_size`` ranks runs the
same sweep at the same time and rank 0's records are kept: the ranks of a ``cpu:W`` cluster
share this machine's caches and memory bandwidth in training, so they must in the profile too
(a GPU profile needs no such thing: each rank has its device).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from costmodel.presets import CPU_HARDWARE
from costmodel.profiling.format import ComputeRecord, HeadRecord, Profile
from costmodel.profiling.sweep import SweepConfig, make_header, run_sweep
from costmodel.specs import ModelSpec
from dcp_cli.check_config import (
    CheckConfig,
    ProgressFn,
    build_reference_model,
    reference_spec,
)
from executor.context import SPContext
from executor.layout import PackedLayout, SampleShape
from executor.ulysses import EmulatedGroup


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


def _sweep_config(config: CheckConfig) -> SweepConfig:
    return SweepConfig(tokens_min=config.tokens_min, tokens_max=config.tokens_max, num_sizes=config.sweep_sizes,
                       packings=(2, 4), num_packed=3, frames=(1, 2, 4, 8),
                       layer_counts=tuple(sorted({1, 2, config.num_layers})),
                       num_head_sizes=5, warmup=2, repeats=config.sweep_repeats, seed=config.seed,
                       cpu_clock=config.clock, group_sizes=tuple(config.group_sizes))


def sweep_records(config: CheckConfig) -> list[ComputeRecord | HeadRecord]:
    """The profiling sweep of the reference layers and head in this process (one torch thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_sweep(reference_spec(config), _sweep_config(config), device=torch.device("cpu"),
                         dtype="float32", layer_factory=_layer_factory(config),
                         head_factory=_head_factory(config))
    finally:
        torch.set_num_threads(threads)


def sweep_message(config: CheckConfig) -> str:
    """The progress line of the compute profile."""
    concurrent = config.concurrent and config.world_size > 1
    return (f"profiling the executor's {config.kind} layers"
            + (f" ({config.world_size} ranks at once)" if concurrent else ""))


def compute_profile(config: CheckConfig, records: Sequence[ComputeRecord | HeadRecord]) -> Profile:
    """The compute and head profile of ``records`` (rank 0's, when the ranks swept at once)."""
    spec = reference_spec(config)
    concurrent = config.concurrent and config.world_size > 1
    header = make_header(model=spec, profiled=spec, hardware=CPU_HARDWARE, device=torch.device("cpu"),
                         dtype="float32", cpu_clock=config.clock,
                         notes="dcp check-model: the executor's reference layers"
                               + (f", {config.world_size} ranks sweeping at once" if concurrent else ""))
    return Profile(header=header, compute=[r for r in records if isinstance(r, ComputeRecord)],
                   head=[r for r in records if isinstance(r, HeadRecord)])


def _sweep_worker(rank: int, out: str, config_json: str) -> None:
    """One of the ranks sweeping at once; rank 0 writes its records."""
    records = sweep_records(CheckConfig(**json.loads(config_json)))
    if rank == 0:
        Path(out).write_text(json.dumps([r.model_dump(mode="json") for r in records]))


def profile_reference(config: CheckConfig, *, progress: ProgressFn | None = None) -> Profile:
    """Compute and head profile of the reference model on this CPU (one torch thread per rank;
    all ``world_size`` ranks at once when ``config.concurrent``), in processes of its own
    (``dcp check-model`` runs the same sweep inside its one world of ranks)."""
    if progress:
        progress(sweep_message(config))
    if config.concurrent and config.world_size > 1:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "records.json"
            mp.spawn(_sweep_worker, args=(str(out), json.dumps(asdict(config))),
                     nprocs=config.world_size, join=True)
            records = [HeadRecord.model_validate(r) if r["record"] == "head"
                       else ComputeRecord.model_validate(r) for r in json.loads(out.read_text())]
    else:
        records = sweep_records(config)
    return compute_profile(config, records)
