"""Gradient sync as users run it (DDP, FSDP2) on the world-4 scenarios; runs inside scenarios.worker.

Every rank runs the 1D and 2D plans of :mod:`tests.executor.scenarios` (uneven micro-batch
counts, mixed policies in a last micro-batch, an idle rank) with the reference model wrapped in
``DistributedDataParallel`` or ``fully_shard`` (per layer, then the root), and records the
summed gradients (FSDP2: the full tensor of each shard), its optimizer-state bytes and the
parameters after AdamW steps.
"""

from __future__ import annotations

import torch
from torch import nn

from executor.grad_sync import DDPSync, FSDP2Sync
from executor.groups import GroupRegistry
from executor.models import Llama1D, STDiT2D
from executor.runtime import Executor
from planner.plan import Plan
from tests.executor.helpers import CONFIG, build_model, dataset_for


def idle_item(kind: str) -> dict[str, object]:
    """One token of zeros: what a rank without micro-batches runs at loss weight zero."""
    if kind == "1d":
        return {"inputs": torch.zeros(1, dtype=torch.long), "targets": torch.zeros(1, dtype=torch.long)}
    return {"inputs": torch.zeros(1, CONFIG.in_channels, dtype=torch.float64),
            "targets": torch.zeros(1, CONFIG.in_channels, dtype=torch.float64)}


def _wrap(mode: str, model: nn.Module, kind: str) -> tuple[nn.Module, DDPSync | FSDP2Sync]:
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
        return ddp, DDPSync(ddp, idle_item=idle_item(kind))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, FSDP2Sync(model, idle_item=idle_item(kind))


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _step(executor: Executor, model: nn.Module, plan: Plan, kind: str) -> None:
    """The user's loop, unchanged from the all-reduce one."""
    rank_plan = plan.rank_view(executor.rank)
    executor.begin_step(rank_plan, step=plan.step or 0)
    data = dataset_for(plan, kind)
    token_losses = Llama1D.token_losses if kind == "1d" else STDiT2D.token_losses
    for work in executor.micro_batches(rank_plan, load_sample=data.load):
        out = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
        work.loss(token_losses(out, work.targets)).backward()
    executor.sync_gradients(model)


def run(rank: int, registry: GroupRegistry, plans: dict[str, list[Plan]], results: dict[str, object]) -> None:
    """Each mode on each kind: gradients of every plan, state bytes, parameters after AdamW."""
    for mode in ("ddp", "fsdp2"):
        for kind, kind_plans in plans.items():
            model, sync = _wrap(mode, build_model(kind), kind)
            executor = Executor(registry=registry, grad_sync=sync)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for i, plan in enumerate(kind_plans):
                opt.zero_grad(set_to_none=True)
                _step(executor, model, plan, kind)
                results[f"{mode}_grad_{kind}_{i}"] = [_full(p.grad) for p in model.parameters()]  # type: ignore[arg-type]
                opt.step()
            results[f"{mode}_params_{kind}"] = [_full(p) for p in model.parameters()]
            results[f"{mode}_state_bytes_{kind}"] = sum(
                getattr(v, "to_local", lambda v=v: v)().numel() * v.element_size()
                for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
