"""What every rank of the ring integration tests runs (one spawn of 4 gloo ranks for all of them).

1. ``llama``: ``transformers``' ``LlamaForCausalLM`` (8 query heads over 2 key/value heads) under the
   executor's ring scenarios (``tests/executor/test_ring_step.py``: 1 x 2 beside a Ulysses pair,
   2 x 2, 1 x 4), process groups for those layouts;
2. ``served``: the same model under every step of a ``layout="ring"`` epoch of a real ``dcp serve``,
   process groups from the epoch's declared layouts (``PlannerClient.epoch_layouts``,
   ``GroupRegistry.from_layouts``), heads checked against ``GroupRegistry.ulysses_degrees``;
3. ``wan``: diffusers' ``WanTransformer3DModel`` under ``hf_wan_model.ring_plans()`` (1 x 2, 2 x 2,
   1 x 4 over each clip's self-attention);
4. ``latte``: Latte's forward handed a ring micro-batch (its error message).

Each rank writes its losses and gradients to ``rank<r>.pt`` (an ``error`` entry when a run failed).
"""

from __future__ import annotations

from typing import Any

import torch

from executor.client import PlannerClient, RetryPolicy
from executor.groups import GroupRegistry
from executor.runtime import Executor
from tests.executor.helpers import gloo_rank
from tests.executor.integrations import hf_latte, hf_llama, hf_wan_model
from tests.executor.test_ring_step import plans as ring_step_plans

WORLD = 4
LAYOUTS = [(1, 2), (2, 2), (1, 4)]
"""The Ulysses x ring layouts ``(u, r)`` of the hand-made plans."""
KV_HEADS = 2
"""Key/value heads of the Llama (8 query heads): GQA, a Ulysses degree of 2 splits them."""


def llama_plans() -> dict[str, Any]:
    """The executor's ring scenarios of a world of 4 on the causal 1D kind, by name."""
    return ring_step_plans(WORLD, "1d")


def _llama(rank: int, results: dict[str, object]) -> None:
    from executor.integrations import hf_transformers as hf

    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4], layouts=LAYOUTS)
    executor = Executor(registry=registry)
    model = hf_llama.build(hf.register(), dtype=torch.float64, kv_heads=KV_HEADS)
    hf.prepare(model, group_sizes=registry.ulysses_degrees)
    for name, plan in llama_plans().items():
        model.zero_grad(set_to_none=True)
        results[f"llama_loss_{name}"] = hf_llama.run_step(executor, model, plan)
        results[f"llama_grad_{name}"] = hf_llama.grads(model)


def _served(rank: int, url: str, epoch_id: str, results: dict[str, object]) -> None:
    from executor.integrations import hf_transformers as hf

    with PlannerClient(url, retry=RetryPolicy(deadline_s=30)) as client:
        layouts = client.epoch_layouts(epoch_id)
        assert layouts is not None, "the epoch declares no layouts"
        registry = GroupRegistry.from_layouts(world_size=WORLD, rank=rank, layouts=layouts)
        results["served_sizes"], results["served_ulysses_degrees"] = registry.sizes, registry.ulysses_degrees
        executor = Executor(registry=registry)
        model = hf_llama.build(hf.register(), dtype=torch.float64, kv_heads=KV_HEADS)
        hf.prepare(model, group_sizes=registry.ulysses_degrees)
        num_steps = int(client.epoch_status(epoch_id)["steps_total"])
        for step in range(num_steps):
            plan, _ = client.step_plan(epoch_id, step)
            model.zero_grad(set_to_none=True)
            results[f"served_loss_{step}"] = hf_llama.run_step(executor, model, plan)
            results[f"served_grad_{step}"] = hf_llama.grads(model)


def _wan(rank: int, results: dict[str, object]) -> None:
    from executor.integrations import hf_wan

    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4], layouts=LAYOUTS)
    executor = Executor(registry=registry)
    model = hf_wan_model.build()
    hf_wan.prepare(model, group_sizes=registry.ulysses_degrees)
    for i, plan in enumerate(hf_wan_model.ring_plans()):
        model.zero_grad(set_to_none=True)
        results[f"wan_loss_{i}"] = hf_wan_model.run_step(executor, model, plan)
        results[f"wan_grad_{i}"] = hf_llama.grads(model)
    # Latte (spatial and temporal attention) handed a micro-batch of the 2 x 2 ring group
    from executor.integrations import hf_diffusers

    latte = hf_latte.build()
    hf_diffusers.prepare(latte, group_sizes=[1, 2])
    plan = hf_wan_model.ring_plans()[1]
    rank_plan = plan.rank_view(rank)
    executor.begin_step(rank_plan, step=1)
    works = executor.micro_batches(rank_plan, load_sample=lambda s: {
        "inputs": torch.zeros(s.tokens, 1), "targets": torch.zeros(s.tokens, 1)})
    try:
        hf_diffusers.forward(latte, next(works), videos=[], timesteps=torch.zeros(0), captions=torch.zeros(0))
        results["latte_error"] = None
    except ValueError as err:
        results["latte_error"] = str(err)


def worker(rank: int, port: int, url: str, epoch_id: str, out_dir: str) -> None:
    """Every ring integration scenario on one rank; results to ``out_dir/rank<r>.pt``."""
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        _llama(rank, results)
        _served(rank, url, epoch_id, results)
        _wan(rank, results)
