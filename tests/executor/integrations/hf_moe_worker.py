"""What every rank of the MoE and windowed-attention integration tests runs (one spawn of 4 gloo
ranks for all of them).

For each model of ``hf_moe_models.NAMES`` (fp64, the DCP attention, ``hf.prepare``):

1. ``ulysses``: the scenario plans ``scenarios.plans_1d()`` (groups 2+1+1, 4 and 1+2+1: 1, 2 and 4
   ranks, the groups of 4 past the 2 key/value heads, packed micro-batches, mixed per-sample
   checkpoint policies, an idle rank, token and sample normalisation);
2. ``ring``: the ring scenarios of ``test_ring_step.py`` (1 x 2 beside a Ulysses pair, 2 x 2, 1 x 4),
   the ring's forward steps counted (``executor.ring.record_ring_events``): every layer goes round
   the ring (windowed layers on the window-aware ring, gpt-oss's sinks on the ring's output);
   gpt-oss and Gemma 3 also with the loss in chunks on the 4-rank plan;
3. ``fsdp2`` (Qwen3-MoE and gpt-oss): plans 0 and 1 of (1) under FSDP2 (``fully_shard`` per decoder
   layer, then the root: the experts' weights sharded over the 4 ranks like every other weight).

Each rank writes its loss shares and gradients to ``rank<r>.pt`` (an ``error`` entry when a run failed).
"""

from __future__ import annotations

from typing import Any

import torch

from executor.groups import GroupRegistry
from executor.ring import record_ring_events
from executor.runtime import Executor
from tests.executor import scenarios
from tests.executor.helpers import gloo_rank
from tests.executor.integrations import hf_llama, hf_moe_models
from tests.executor.test_ring_step import plans as ring_step_plans

WORLD = 4
LAYOUTS = [(1, 2), (2, 2), (1, 4)]
"""The Ulysses x ring layouts ``(u, r)`` of the ring scenarios."""
FSDP2_MODELS = ("qwen3_moe", "gpt_oss")
CHUNKED_MODELS = ("gpt_oss", "gemma3")
"""Models also run with the loss in chunks (``hf.lm_token_losses``) on the 4-rank plan (Gemma 3's
head is tied to its scaled embedding)."""


def ring_plans() -> dict[str, Any]:
    """The ring scenarios of a world of 4 (causal 1D), by name."""
    return ring_step_plans(WORLD, "1d")


def _model(name: str, registry: GroupRegistry) -> Any:
    from executor.integrations import hf_transformers as hf

    model = hf_moe_models.build(name, hf.register(), dtype=torch.float64)
    return hf.prepare(model, group_sizes=registry.ulysses_degrees)


def _ulysses_and_rings(rank: int, name: str, results: dict[str, object]) -> None:
    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4], layouts=LAYOUTS)
    executor = Executor(registry=registry)
    model = _model(name, registry)
    for i, plan in enumerate(scenarios.plans_1d()):
        model.zero_grad(set_to_none=True)
        results[f"{name}_ulysses_loss_{i}"] = hf_llama.run_step(executor, model, plan)
        results[f"{name}_ulysses_grad_{i}"] = hf_llama.grads(model)
        if name in CHUNKED_MODELS and i == 1:  # the loss in chunks of 3 tokens (hf.lm_token_losses)
            model.zero_grad(set_to_none=True)
            results[f"{name}_chunked_loss_{i}"] = hf_llama.run_step(executor, model, plan, loss_chunk_tokens=3)
            results[f"{name}_chunked_grad_{i}"] = hf_llama.grads(model)
    for key, plan in ring_plans().items():
        model.zero_grad(set_to_none=True)
        with record_ring_events() as events:
            results[f"{name}_ring_loss_{key}"] = hf_llama.run_step(executor, model, plan)
        results[f"{name}_ring_grad_{key}"] = hf_llama.grads(model)
        results[f"{name}_ring_attends_{key}"] = sum(1 for p, _, what in events if (p, what) == ("forward", "attend"))


def _fsdp2(rank: int, name: str, results: dict[str, object]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from executor.grad_sync import FSDP2Sync
    from executor.integrations import hf_transformers as hf

    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
    model = _model(name, registry)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in hf.decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    results[f"{name}_fsdp2_expert_rows"] = experts.gate_up_proj.to_local().shape[0]
    one_token = {"inputs": torch.zeros(1, dtype=torch.long), "targets": torch.zeros(1, dtype=torch.long)}
    executor = Executor(registry=registry, grad_sync=FSDP2Sync(model, idle_item=one_token))
    for i, plan in enumerate(scenarios.plans_1d()[:2]):
        model.zero_grad(set_to_none=True)
        results[f"{name}_fsdp2_loss_{i}"] = hf_llama.run_step(executor, model, plan)
        results[f"{name}_fsdp2_grad_{i}"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every MoE and windowed-attention scenario on one rank; results to ``out_dir/rank<r>.pt``."""
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        for name in hf_moe_models.NAMES:
            _ulysses_and_rings(rank, name, results)
        for name in FSDP2_MODELS:
            _fsdp2(rank, name, results)
