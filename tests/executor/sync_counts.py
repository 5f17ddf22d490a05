"""Every rank counts the gradient sync's collectives and its model-state bytes under DDP and FSDP2.

Run under ``torch.multiprocessing.spawn`` by ``test_sync_cost_model.py`` (world of 4, fp32, the
1D reference model): the rank wraps the ``torch.distributed`` functions the sync modes call
(``all_reduce`` from DDPSync's comm hook, ``all_gather_single`` and ``reduce_scatter_single``
from FSDP2) and others they might call, runs three planned steps with AdamW between them
(DDP rebuilds its buckets at the second), and records for the third step the calls and bytes of
each collective, the collectives the gloo backend ran (torch profiler), and the bytes of the
unique storages of the parameters, gradients, optimizer states (and DDP's bucket buffers: the
all-reduced tensors), to ``<out_dir>/rank<r>.pt``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executor.grad_sync import DDPSync, FSDP2Sync
from executor.groups import GroupRegistry
from executor.models import Llama1D
from executor.runtime import Executor
from tests.executor.helpers import build_model, dataset_for, gloo_rank
from tests.executor.scenarios import WORLD, plans_1d
from tests.executor.sync_scenarios import idle_item

COUNTED = {  # collective -> (positional index, keyword) of the tensor whose bytes are counted
    "all_reduce": (0, "tensor"),
    "all_gather_single": (0, "output_tensor"),  # the gathered output: the whole parameters
    "reduce_scatter_single": (1, "input"),  # the reduced input: the whole gradients
    "all_gather_into_tensor": (0, "output_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "broadcast": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_to_all_single": (1, "input"),
}


class Counters:
    """Calls and bytes per wrapped ``torch.distributed`` function; the tensors all-reduced."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {name: [0, 0] for name in COUNTED}
        self.allreduced: list[torch.Tensor] = []

    def install(self) -> None:
        """Replace the functions in ``torch.distributed`` with counting ones."""
        for name, (index, keyword) in COUNTED.items():
            setattr(dist, name, self._wrap(name, getattr(dist, name), index, keyword))

    def _wrap(self, name: str, fn: Callable[..., Any], index: int, keyword: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[index] if len(args) > index else kwargs[keyword]
            if isinstance(tensor, torch.Tensor):
                self.counts[name][0] += 1
                self.counts[name][1] += tensor.numel() * tensor.element_size()
                if name == "all_reduce":
                    self.allreduced.append(tensor)
            return fn(*args, **kwargs)
        return counted

    def take(self) -> dict[str, tuple[int, int]]:
        """``{name: (calls, bytes)}`` of the functions called since the last take; resets."""
        out = {name: (c, b) for name, (c, b) in self.counts.items() if c}
        self.counts = {name: [0, 0] for name in COUNTED}
        self.allreduced = []
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the unique storages behind ``tensors`` (DTensors: their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's moments (the 0-dim step counters left out)."""
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def _fsdp_sharded(model: nn.Module) -> list[torch.Tensor]:
    """The sharded parameters (fp32 masters) of every ``fully_shard`` unit."""
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group  # no public accessor
            if group is not None:
                out.extend(fp.sharded_param for fp in group.fsdp_params)
    return out


def _backend_ops(profiler: torch.profiler.profile) -> dict[str, int]:
    """Calls per collective the gloo backend ran (``gloo:*`` events), from Python or C++."""
    ops: dict[str, int] = {}
    for event in profiler.events():
        if event.name.startswith("gloo:"):
            ops[event.name] = ops.get(event.name, 0) + 1
    return ops


def _wrap(mode: str, model: nn.Module, *, bucket_cap_mb: float | None) -> tuple[nn.Module, DDPSync | FSDP2Sync]:
    if mode == "ddp":
        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        ddp = nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False, **kwargs)  # type: ignore[arg-type]
        return ddp, DDPSync(ddp, idle_item=idle_item("1d"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, FSDP2Sync(model, idle_item=idle_item("1d"))


def _run(rank: int, registry: GroupRegistry, mode: str, counters: Counters, *,
         bucket_cap_mb: float | None) -> dict[str, object]:
    """Three steps (plans 0, 2, 1: every rank has 3 micro-batches in the last); the last one's record.

    DDP rebuilds its buckets at the second step's first forward (a one-off broadcast of the
    bucket order, issued from C++), so the third step shows what every later step issues.
    """
    start_cpu_s = time.process_time()
    model, sync = _wrap(mode, build_model("1d", dtype=torch.float32), bucket_cap_mb=bucket_cap_mb)
    executor = Executor(registry=registry, grad_sync=sync)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    record: dict[str, object] = {}
    plans = plans_1d()
    for step, plan in enumerate([plans[0], plans[2], plans[1]]):
        plan = plan.model_copy(update={"step": step})
        opt.zero_grad(set_to_none=True)
        rank_plan = plan.rank_view(rank)
        executor.begin_step(rank_plan, step=step)
        counters.take()  # the plan-digest check is the executor's, not the sync's
        data = dataset_for(plan, "1d", dtype=torch.float32)
        works = rank_plan.group.micro_batches
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if step == 2:  # only the counted step: the profiler costs seconds per run
            profiler.start()
        for i, work in enumerate(executor.micro_batches(rank_plan, load_sample=data.load)):
            out = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
            loss = work.loss(Llama1D.token_losses(out, work.targets))
            if mode == "fsdp2" and i == len(works) - 1:  # the peak: everything unsharded, no reduce yet
                record["peak_state_bytes"] = storage_bytes(
                    [*model.parameters(), *(p.grad for p in model.parameters()), *_fsdp_sharded(model),
                     *_optimizer_tensors(opt)])
            loss.backward()
        executor.sync_gradients(model)
        buckets = list(counters.allreduced)
        record["counts"] = counters.take()
        if step == 2:
            profiler.stop()
            record["backend_ops"] = _backend_ops(profiler)
        opt.step()
    record["cpu_s"] = time.process_time() - start_cpu_s
    params = list(model.parameters())
    record["after_step_state_bytes"] = storage_bytes(
        [*params, *(p.grad for p in params), *_optimizer_tensors(opt), *buckets])
    return record


def worker(rank: int, port: int, out_dir: str, ddp_caps_mb: list[float | None]) -> None:
    """DDP at each bucket cap (``None``: DDP's default), then FSDP2; results to ``out_dir``."""
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        counters = Counters()
        counters.install()
        registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
        for cap in ddp_caps_mb:
            results[f"ddp_{cap}"] = _run(rank, registry, "ddp", counters, bucket_cap_mb=cap)
        results["fsdp2"] = _run(rank, registry, "fsdp2", counters, bucket_cap_mb=None)
