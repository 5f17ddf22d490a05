"""GPU: the executor's step on CUDA equals the CPU step (skipped without a GPU, never faked)."""

from __future__ import annotations

import pytest
import torch

from executor.groups import GroupRegistry
from executor.runtime import Executor
from tests.executor.helpers import build_model, dataset_for, make_plan, s1d, s2d

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_cuda_step_matches_cpu_step(kind: str) -> None:
    if kind == "1d":
        micro = [[(s1d("a", 37), 0), (s1d("b", 12), 3)], [(s1d("c", 20), 1)]]
    else:
        micro = [[(s2d("A", 3, 2, 5), 2), (s2d("B", 1, 4, 4), 0)], [(s2d("C", 4, 3, 1), 3)]]
    plan = make_plan([([0], micro)], num_ranks=1)
    grads = {}
    for device in ("cpu", "cuda"):
        model = build_model(kind).to(device)
        executor = Executor(registry=GroupRegistry(world_size=1, rank=0, group_sizes=[1]),
                            device=device)
        rank_plan = plan.rank_view(0)
        executor.begin_step(rank_plan, step=0)
        data = dataset_for(plan, kind)
        for work in executor.micro_batches(rank_plan, load_sample=data.load):
            out = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
            work.loss(model.token_losses(out, work.targets)).backward()  # type: ignore[operator]
        executor.sync_gradients(model)
        grads[device] = [p.grad.detach().cpu() for p in model.parameters()]  # type: ignore[union-attr]
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["cpu"], grads["cuda"], strict=True))
    assert diff <= 1e-9, diff
