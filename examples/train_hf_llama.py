"""Train an unmodified Hugging Face ``transformers`` Llama with plans from the planner service (CPU, gloo).

Run (with a service on 127.0.0.1:8000, e.g. ``dcp serve``; needs ``pip install -e '.[hf]'``)::

    torchrun --nproc_per_node 4 examples/train_hf_llama.py --url http://127.0.0.1:8000 --steps 4
    torchrun --nproc_per_node 4 examples/train_hf_llama.py --grad-sync ddp     # or fsdp2
    torchrun --nproc_per_node 4 examples/train_hf_llama.py --layout ring      # ring attention groups

An ordinary ``transformers`` training loop (a small random-initialised ``LlamaForCausalLM``, no
download); the lines marked ``# [dcp k/12]`` are all it takes to run it under DCP plans: the
attention plugin and per-sample checkpointing, process groups (the attention layouts the epoch
declares: Ulysses, and with ``--layout ring``/``auto`` Ulysses x ring), plan prefetch, digest
check, per-plan micro-batches with sequence parallelism, and the gradient sync of your choice
(``allreduce``, DDP or FSDP2).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import manifest, model_spec, parse_args, start_epoch

from executor.client import PlannerClient, PlanPrefetcher, RetryPolicy  # [dcp 1/12]
from executor.data import PlanBatchSampler, SyntheticDataset, collate_items
from executor.grad_sync import AllReduceSync, DDPSync, FSDP2Sync, GradSync
from executor.groups import GroupRegistry
from executor.integrations import hf_transformers as hf
from executor.models import ModelConfig
from executor.runtime import Executor


def wrap(model: torch.nn.Module, mode: str) -> tuple[torch.nn.Module, GradSync]:
    """The user's choice of data parallelism, and the matching gradient sync."""
    one_token = {"inputs": torch.zeros(1, dtype=torch.long), "targets": torch.zeros(1, dtype=torch.long)}
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)
        return model, DDPSync(model, idle_item=one_token)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in hf.decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, FSDP2Sync(model, idle_item=one_token)
    return model, AllReduceSync()


def main() -> None:
    """Train for ``--steps`` steps and print the loss of each."""
    args = parse_args(__doc__ or "", extra=[
        ("--grad-sync", {"choices": ["allreduce", "ddp", "fsdp2"], "default": "allreduce"}),
        ("--layout", {"default": "ulysses", "choices": ["ulysses", "auto", "ring"],
                      "help": "Attention layouts the planner may give a group (auto, ring: Ulysses x ring groups)."})])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    samples = manifest("1d", num_samples=args.num_samples, seed=args.seed)
    dataset = SyntheticDataset(samples, kind="1d", vocab=config.vocab_size, seed=args.seed)
    shape = ModelConfig(num_layers=config.num_hidden_layers, hidden=config.hidden_size,
                        num_heads=config.num_attention_heads, ffn_hidden=config.intermediate_size,
                        vocab=config.vocab_size)
    client = PlannerClient(args.url, retry=RetryPolicy(deadline_s=args.deadline_s))  # [dcp 2/12]
    epoch_id, num_steps = start_epoch(client, spec=model_spec(shape, kind="1d", name="hf-llama-tiny"),
                                      samples=samples, world_size=world, args=args)
    steps = min(args.steps, num_steps)
    registry = GroupRegistry.from_layouts(world_size=world, rank=rank,  # [dcp 3/12]
                                          layouts=client.epoch_layouts(epoch_id) or [(1, 1, 1)])

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation=hf.register())  # [dcp 4/12]
    hf.prepare(model, group_sizes=registry.ulysses_degrees)  # [dcp 5/12] (a ring's u divides the heads)
    model, grad_sync = wrap(model, args.grad_sync)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    executor = Executor(registry=registry, weight_dtype=torch.float32, grad_sync=grad_sync)  # [dcp 6/12]
    plans = PlanPrefetcher(client, epoch_id=epoch_id, rank=rank, num_steps=num_steps)  # [dcp 7/12]
    sampler = PlanBatchSampler(plan_for_step=plans.get, steps=range(steps),  # [dcp 8/12]
                               index_of=dataset.index_of)
    batches = iter(DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_items))

    for step in range(steps):
        rank_plan = plans.get(step)  # [dcp 9/12]
        executor.begin_step(rank_plan, step=step)  # [dcp 10/12]
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros(())
        for work in executor.micro_batches(rank_plan, loaded=batches):  # [dcp 11/12]
            # the loss in chunks of 4,096 tokens (the planner's default), never the whole logits
            loss = work.loss(hf.lm_token_losses(model, work))  # [dcp 12/12]
            loss.backward()
            step_loss += loss.detach()
        executor.sync_gradients(model)  # (a no-op under DDP and FSDP2: the last backward synced)
        optimizer.step()
        dist.all_reduce(step_loss)
        if rank == 0:
            rings = rank_plan.ring_degrees or [1] * len(rank_plan.group_sizes)
            print(f"step {step}: loss {step_loss.item():.4f} group sizes {rank_plan.group_sizes} ring degrees {rings} "
                  f"sync {args.grad_sync} digest {rank_plan.plan_digest[:12]}", flush=True)
    plans.close()
    client.close()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {steps} steps of epoch {epoch_id} on {world} ranks")


if __name__ == "__main__":
    main()
