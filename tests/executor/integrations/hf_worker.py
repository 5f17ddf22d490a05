"""What every rank of the integration tests runs (one spawn for all of them, world of 4)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from executor.groups import GroupRegistry
from executor.runtime import Executor
from planner.plan import Plan
from tests.executor import scenarios
from tests.executor.helpers import gloo_rank
from tests.executor.integrations import hf_hunyuan_model, hf_latte, hf_llama, hf_wan_model

WORLD = 4


def _llama(rank: int, results: dict[str, object]) -> None:
    from executor.integrations import hf_transformers as hf

    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
    executor = Executor(registry=registry)
    model = hf_llama.build(hf.register(), dtype=torch.float64)
    hf.prepare(model, group_sizes=registry.sizes)
    for dtype, tag, plans in ((torch.float64, "64", scenarios.plans_1d()),
                              (torch.float32, "32", scenarios.plans_1d()[:2])):
        model.to(dtype)  # the fp32 values are those the model was initialised with
        for i, plan in enumerate(plans):
            model.zero_grad(set_to_none=True)
            results[f"llama{tag}_loss_{i}"] = hf_llama.run_step(executor, model, plan)
            results[f"llama{tag}_grad_{i}"] = hf_llama.grads(model)
            if dtype == torch.float64:  # the loss in chunks of 3 tokens (shards split unevenly)
                model.zero_grad(set_to_none=True)
                results[f"llama64chunked_loss_{i}"] = hf_llama.run_step(executor, model, plan, loss_chunk_tokens=3)
                results[f"llama64chunked_grad_{i}"] = hf_llama.grads(model)


def _llama_gqa(rank: int, results: dict[str, object]) -> None:
    """8 query heads over 2 key/value heads: the groups of 4 run past the key/value heads."""
    from executor.integrations import hf_transformers as hf

    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
    executor = Executor(registry=registry)
    model = hf_llama.build(hf.register(), dtype=torch.float64, kv_heads=2)
    hf.prepare(model, group_sizes=registry.sizes)
    for i, plan in enumerate(scenarios.plans_1d()):
        model.zero_grad(set_to_none=True)
        results[f"llama_gqa_loss_{i}"] = hf_llama.run_step(executor, model, plan)
        results[f"llama_gqa_grad_{i}"] = hf_llama.grads(model)


def _llama_fsdp2(rank: int, results: dict[str, object]) -> None:
    """The fp32 Llama under FSDP2 (per decoder layer, then the root): the sync users run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from executor.grad_sync import FSDP2Sync
    from executor.integrations import hf_transformers as hf

    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
    model = hf_llama.build(hf.register(), dtype=torch.float32)
    hf.prepare(model, group_sizes=registry.sizes)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in hf.decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    one_token = {"inputs": torch.zeros(1, dtype=torch.long), "targets": torch.zeros(1, dtype=torch.long)}
    executor = Executor(registry=registry, grad_sync=FSDP2Sync(model, idle_item=one_token))
    for i, plan in enumerate(scenarios.plans_1d()[:2]):
        model.zero_grad(set_to_none=True)
        results[f"llama_fsdp2_loss_{i}"] = hf_llama.run_step(executor, model, plan)
        results[f"llama_fsdp2_grad_{i}"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)  # the chunked loss under FSDP2 (the head's hook inside the root)
        results[f"llama_fsdp2chunked_loss_{i}"] = hf_llama.run_step(executor, model, plan, loss_chunk_tokens=4)
        results[f"llama_fsdp2chunked_grad_{i}"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def _video(rank: int, results: dict[str, object], key: str, model_module: Any, integration: str,
           plans: list[Plan]) -> None:
    """One diffusers video model's planned steps: results under ``{key}_loss_i`` / ``{key}_grad_i``."""
    prepare = importlib.import_module(f"executor.integrations.{integration}").prepare
    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
    executor = Executor(registry=registry)
    model = model_module.build()
    prepare(model, group_sizes=registry.sizes)
    for i, plan in enumerate(plans):
        model.zero_grad(set_to_none=True)
        results[f"{key}_loss_{i}"] = model_module.run_step(executor, model, plan)
        results[f"{key}_grad_{i}"] = hf_llama.grads(model)


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every integration scenario on one rank; results to ``out_dir/rank<r>.pt``."""
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        _llama(rank, results)
        _llama_gqa(rank, results)
        _llama_fsdp2(rank, results)
        _video(rank, results, "latte", hf_latte, "hf_diffusers", hf_latte.plans())
        _video(rank, results, "wan", hf_wan_model, "hf_wan", hf_wan_model.plans())
        _video(rank, results, "hunyuan", hf_hunyuan_model, "hf_hunyuan", hf_wan_model.plans())
