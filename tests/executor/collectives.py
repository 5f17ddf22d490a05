"""Every rank counts the collectives the executor issues per micro-batch (world of 4).

Run under ``torch.multiprocessing.spawn`` by ``test_collective_counts.py``: the rank wraps
``torch.distributed.all_to_all_single`` and ``all_reduce`` with counters (calls and input bytes),
runs the scenario plans micro-batch by micro-batch, and saves the counts to
``<out_dir>/rank<r>.pt``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from executor.groups import GroupRegistry
from executor.runtime import Executor
from tests.executor.helpers import build_model, dataset_for, gloo_rank
from tests.executor.scenarios import WORLD, plans_1d, plans_2d


class Counter:
    """Calls and input bytes of one collective since the last :meth:`take`."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0

    def wrap(self, fn: Callable[..., Any], input_index: int) -> Callable[..., Any]:
        """``fn`` counting its calls and the bytes of its argument ``input_index``."""
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[input_index]
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return counted

    def take(self) -> tuple[int, int]:
        """``(calls, bytes)`` since the last take; resets."""
        out = (self.calls, self.bytes)
        self.calls = self.bytes = 0
        return out


def worker(rank: int, port: int, out_dir: str) -> None:
    """Count per micro-batch, per plan and kind; results to ``out_dir/rank<r>.pt``."""
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        a2a, allreduce = Counter(), Counter()
        dist.all_to_all_single = a2a.wrap(dist.all_to_all_single, 1)  # type: ignore[assignment]
        dist.all_reduce = allreduce.wrap(dist.all_reduce, 0)  # type: ignore[assignment]
        registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
        executor = Executor(registry=registry)
        for kind, plans in (("1d", plans_1d()), ("2d", plans_2d())):
            for i, plan in enumerate(plans):
                model = build_model(kind, dtype=torch.float32)
                rank_plan = plan.rank_view(rank)
                executor.begin_step(rank_plan, step=plan.step or 0)
                a2a.take()
                allreduce.take()
                data = dataset_for(plan, kind, dtype=torch.float32)
                per_mb = []
                for work in executor.micro_batches(rank_plan, load_sample=data.load):
                    out = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
                    work.loss(model.token_losses(out, work.targets)).backward()  # type: ignore[operator]
                    per_mb.append(a2a.take() + allreduce.take())
                executor.sync_gradients(model)
                results[f"{kind}_{i}_mb"] = per_mb
                results[f"{kind}_{i}_sync"] = a2a.take() + allreduce.take()
                results[f"{kind}_{i}_params"] = sum(p.numel() for p in model.parameters())
