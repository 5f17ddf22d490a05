"""Train the LLaMA-style reference model with plans from the planner service (CPU, gloo).

Run (with a service on 127.0.0.1:8000, e.g. ``dcp serve``)::

    torchrun --nproc_per_node 4 examples/train_1d.py --url http://127.0.0.1:8000 --steps 4
    torchrun --nproc_per_node 4 examples/train_1d.py --layout ring   # ring attention groups

An ordinary data-parallel training loop; the lines marked ``# [dcp k/11]`` are all it takes to
run it under DCP plans: process groups (the attention layouts the epoch declares), plan
prefetch, digest check, per-plan micro-batches with sequence parallelism and checkpoint
policies, and one world gradient sum.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import manifest, model_spec, parse_args, start_epoch

from executor.client import PlannerClient, PlanPrefetcher, RetryPolicy  # [dcp 1/11]
from executor.data import PlanBatchSampler, SyntheticDataset, collate_items
from executor.groups import GroupRegistry
from executor.models import Llama1D, ModelConfig, init_weights
from executor.runtime import Executor


def main() -> None:
    """Train for ``--steps`` steps and print the loss of each."""
    args = parse_args(__doc__ or "", extra=[("--layout", {
        "default": "ulysses", "choices": ["ulysses", "auto", "ring"],
        "help": "Attention layouts the planner may give a group (auto, ring: Ulysses x ring groups)."})])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = ModelConfig(num_layers=4, hidden=64, num_heads=4, ffn_hidden=128, vocab=256)
    model = Llama1D(config)
    init_weights(model, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    samples = manifest("1d", num_samples=args.num_samples, seed=args.seed)
    dataset = SyntheticDataset(samples, kind="1d", vocab=config.vocab, seed=args.seed)

    client = PlannerClient(args.url, retry=RetryPolicy(deadline_s=args.deadline_s))  # [dcp 2/11]
    epoch_id, num_steps = start_epoch(client, spec=model_spec(config, kind="1d", name="ref-llama-1d"),
                                      samples=samples, world_size=world, args=args)
    steps = min(args.steps, num_steps)
    registry = GroupRegistry.from_layouts(world_size=world, rank=rank,  # [dcp 3/11]
                                          layouts=client.epoch_layouts(epoch_id) or [(1, 1, 1)])
    executor = Executor(registry=registry, weight_dtype=torch.float32)  # [dcp 4/11]
    plans = PlanPrefetcher(client, epoch_id=epoch_id, rank=rank, num_steps=num_steps)  # [dcp 5/11]
    sampler = PlanBatchSampler(plan_for_step=plans.get, steps=range(steps),  # [dcp 6/11]
                               index_of=dataset.index_of)
    batches = iter(DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_items))

    for step in range(steps):
        rank_plan = plans.get(step)  # [dcp 7/11]
        executor.begin_step(rank_plan, step=step)  # [dcp 8/11]
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros(())
        for work in executor.micro_batches(rank_plan, loaded=batches):  # [dcp 9/11]
            # targets: the loss in chunks of ModelConfig.loss_chunk_tokens, never the whole logits
            losses = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers, targets=work.targets)
            loss = work.loss(losses)  # [dcp 10/11]
            loss.backward()
            step_loss += loss.detach()
        executor.sync_gradients(model)  # [dcp 11/11] (instead of DDP)
        optimizer.step()
        dist.all_reduce(step_loss)
        if rank == 0:
            policies = [ps.recompute_layers for mb in rank_plan.group.micro_batches for ps in mb.samples]
            rings = rank_plan.ring_degrees or [1] * len(rank_plan.group_sizes)
            print(f"step {step}: loss {step_loss.item():.4f} group sizes {rank_plan.group_sizes} ring degrees {rings} "
                  f"rank0 policies {policies} digest {rank_plan.plan_digest[:12]}", flush=True)
    plans.close()
    client.close()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {steps} steps of epoch {epoch_id} on {world} ranks (pid {os.getpid()})")


if __name__ == "__main__":
    main()
