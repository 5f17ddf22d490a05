"""Shared helpers of the executor tests: hand-built plans, reference steps, process spawning.

Plans here are built directly with the plan schema (no solver): the executor's job is to run
whatever valid plan it gets.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from costmodel.specs import Sample
from dcp_cli.check_config import init_rank, joined_rank
from executor.context import SPContext
from executor.data import SyntheticDataset
from executor.joint import JointDiT3D
from executor.layout import PackedLayout
from executor.models import DiT3D, Llama1D, ModelConfig, STDiT2D, init_weights
from executor.runtime import sample_shape, token_weights
from planner.plan import (
    GroupPlan,
    LossNormalizer,
    LowerBound,
    MicroBatch,
    Plan,
    PlannedSample,
    SolverInfo,
)

CONFIG = ModelConfig(num_layers=3, hidden=16, num_heads=4, ffn_hidden=32, vocab=32, in_channels=3)
JOINT_TEXT_TOKENS = 2
"""Text tokens per sample of the joint-attention 3D model (kind ``3d_joint``)."""

GroupSpec = tuple[list[int], list[list[tuple[Sample, int]]]]
"""(ranks, micro-batches of (sample, recompute_layers))."""


def s1d(sample_id: str, tokens: int) -> Sample:
    """A 1D sample."""
    return Sample(id=sample_id, tokens=tokens)


def s2d(sample_id: str, frames: int, height: int, width: int) -> Sample:
    """A 2D sample."""
    return Sample(id=sample_id, tokens=frames * height * width, frames=frames, height=height,
                  width=width)


def make_plan(groups: Sequence[GroupSpec], *, num_ranks: int, step: int = 0,
              normalizer: str = "tokens", cost_model_id: str = "hand") -> Plan:
    """A valid plan with the given groups (predictions are placeholders: zero)."""
    group_plans = []
    samples: list[Sample] = []
    for ranks, micro_batches in groups:
        mbs = []
        for micro in micro_batches:
            mbs.append(MicroBatch(
                samples=[PlannedSample(sample=s, recompute_layers=k, predicted_time_s=0.0,
                                       predicted_activation_bytes=0.0) for s, k in micro],
                predicted_time_s=0.0, predicted_peak_mem_bytes=0.0))
            samples.extend(s for s, _ in micro)
        group_plans.append(GroupPlan(ranks=ranks, micro_batches=mbs, predicted_time_s=0.0,
                                     predicted_peak_mem_bytes=0.0))
    total = sum(s.tokens for s in samples) if normalizer == "tokens" else len(samples)
    return Plan(step=step, num_ranks=num_ranks, groups=group_plans, predicted_step_time_s=0.0,
                grad_sync_time_s=0.0, lower_bound=LowerBound(value_s=0.0, kind="hand"),
                solver=SolverInfo(status="HEURISTIC", method="hand", wall_time_s=0.0),
                loss_normalizer=LossNormalizer(kind=normalizer, total=total),  # type: ignore[arg-type]
                cost_model_id=cost_model_id, cluster_name="cpu4")


def build_model(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                kv_heads: int | None = None) -> torch.nn.Module:
    """A reference model (fp64 by default), deterministically initialised; ``kv_heads``: grouped-query
    self-attention with that many key/value heads (``CONFIG.num_heads`` query heads); kind
    ``3d_joint``: the 3D model with joint (MMDiT-style) text attention."""
    config = dataclasses.replace(CONFIG, num_kv_heads=kv_heads,
                                 joint_text_tokens=JOINT_TEXT_TOKENS if kind == "3d_joint" else 0)
    model = {"1d": Llama1D, "2d": STDiT2D, "3d": DiT3D, "3d_joint": JointDiT3D}[kind](config)
    model = model.to(dtype)
    init_weights(model, seed=seed)
    return model


def dataset_for(plan: Plan, kind: str, *, dtype: torch.dtype = torch.float64) -> SyntheticDataset:
    """Deterministic data for the plan's samples."""
    samples = [ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples]
    return SyntheticDataset(samples, kind="3d" if kind == "3d_joint" else kind, vocab=CONFIG.vocab,
                            channels=CONFIG.in_channels, seed=7, dtype=dtype)


def reference_backward(model: torch.nn.Module, plan: Plan, kind: str) -> None:
    """The plain large-batch step in one process: every sample in one packed batch, no SP."""
    samples = [ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples]
    dtype = next(model.parameters()).dtype
    data = dataset_for(plan, kind, dtype=dtype)
    layout = PackedLayout(samples=tuple(sample_shape(s) for s in samples), group_size=1,
                          index_in_group=0)
    ctx = SPContext(layout=layout, group=None)
    items = [data.load(s) for s in samples]
    inputs = torch.cat([i["inputs"] for i in items])  # type: ignore[misc]
    targets = torch.cat([i["targets"] for i in items])  # type: ignore[misc]
    out = model(inputs, ctx, recompute_layers=[0] * len(samples))
    weights = token_weights(samples, layout, plan.loss_normalizer, dtype=dtype, device="cpu")
    (model.token_losses(out, targets) * weights).sum().backward()  # type: ignore[operator]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a gloo world on loopback (one thread per rank, collectives time out after 60 s)."""
    init_rank(rank, world_size, port, timeout_s=60)


def gloo_rank(rank: int, world_size: int, port: int, out_dir: str | Path,
              backend: str = "gloo") -> contextlib.AbstractContextManager[dict[str, Any]]:
    """One spawned rank's life (``dcp_cli.check_config.joined_rank``, the check's own, 60 s
    collective timeout; gloo unless ``backend`` says otherwise, e.g. ``nccl`` after
    ``torch.cuda.set_device``), its results (tensors too) saved to ``out_dir/rank<r>.pt`` whatever
    happens, with the traceback under ``error`` when the body raised. Read them back with
    :func:`load_rank_results`.
    """
    path = Path(out_dir) / f"rank{rank}.pt"
    return joined_rank(rank, world_size, port, save=lambda results: torch.save(results, path), timeout_s=60,
                       backend=backend)


def load_rank_results(out_dir: str | Path, world_size: int) -> list[dict[str, object]]:
    """What :func:`gloo_rank` saved for each rank, in rank order; fails on a rank's error."""
    loaded = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world_size)]
    for r, res in enumerate(loaded):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return loaded
