"""Train an unmodified diffusers Wan 2.x video transformer (full 3D attention) with plans from the
planner service (CPU, gloo).

Run (with a service on 127.0.0.1:8000, e.g. ``dcp serve``; needs ``pip install -e '.[hf]'``)::

    torchrun --nproc_per_node 4 examples/train_hf_wan.py --url http://127.0.0.1:8000 --steps 4
    torchrun --nproc_per_node 4 examples/train_hf_wan.py --layout ring   # ring self-attention groups

A small random-initialised ``WanTransformer3DModel`` (self-attention over each whole clip with 3D
rotary positions, text cross-attention, per-token timestep modulation; no download) learns to
predict the noise of synthetic latent videos of different shapes and lengths. The lines marked
``# [dcp k/12]`` are all it takes to run it under DCP plans; the process groups are those of the
attention layouts the epoch declares (with ``--layout ring``/``auto``: Ulysses x ring groups, the
ring over each clip's self-attention; the text cross-attention stays local).
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_spec, parse_args, start_epoch

from costmodel.specs import Sample
from executor.client import PlannerClient, PlanPrefetcher, RetryPolicy  # [dcp 1/12]
from executor.groups import GroupRegistry
from executor.integrations import hf_wan
from executor.models import ModelConfig
from executor.runtime import Executor

PATCH, CHANNELS, TEXT_TOKENS, TEXT_DIM = (1, 2, 2), 4, 3, 16


def manifest(num_samples: int, seed: int) -> list[Sample]:
    """Clips of 1 to 8 latent frames (images and videos) and 2 to 6 patches a side."""
    rng = random.Random(seed)
    out = []
    for i in range(num_samples):
        f, h, w = rng.choice([1, 2, 4, 8]), rng.choice([2, 4, 6]), rng.choice([2, 4, 6])
        out.append(Sample(id=f"clip-{i}", tokens=f * h * w, frames=f, height=h, width=w))
    return out


def load(sample: Sample, seed: int) -> dict[str, torch.Tensor]:
    """A synthetic noised latent video, its noise (the target), timestep and text states."""
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}:{sample.id}".encode()).digest()[:7],
                                                       "little"))
    shape = (CHANNELS, sample.num_frames * PATCH[0], int(sample.height or 1) * PATCH[1],
             int(sample.width or 1) * PATCH[2])
    noise = torch.randn(shape, generator=gen)
    video = torch.randn(shape, generator=gen) * 0.5 + noise
    patches = hf_wan.patchify(noise, PATCH)
    return {"id": sample.id, "inputs": patches, "targets": patches, "video": video,  # type: ignore[dict-item]
            "timestep": torch.randint(1000, (1,), generator=gen),
            "text": torch.randn(TEXT_TOKENS, TEXT_DIM, generator=gen)}


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

    heads, head_dim, layers = 4, 16, 2
    torch.manual_seed(args.seed)
    model: torch.nn.Module = WanTransformer3DModel(  # type: ignore[assignment]
        patch_size=PATCH, num_attention_heads=heads, attention_head_dim=head_dim, in_channels=CHANNELS,
        out_channels=CHANNELS, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=4 * heads * head_dim, num_layers=layers,
        rope_max_seq_len=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    samples = manifest(args.num_samples, args.seed)

    shape = ModelConfig(num_layers=layers, hidden=heads * head_dim, num_heads=heads, ffn_hidden=4 * heads * head_dim,
                        in_channels=CHANNELS)
    client = PlannerClient(args.url, retry=RetryPolicy(deadline_s=args.deadline_s))  # [dcp 2/12]
    epoch_id, num_steps = start_epoch(client, spec=model_spec(shape, kind="3d", name="hf-wan-tiny"),
                                      samples=samples, world_size=world, args=args)
    steps = min(args.steps, num_steps)
    registry = GroupRegistry.from_layouts(world_size=world, rank=rank,  # [dcp 3/12]
                                          layouts=client.epoch_layouts(epoch_id) or [(1, 1, 1)])
    hf_wan.prepare(model, group_sizes=registry.ulysses_degrees)  # [dcp 4/12] (a ring's u divides the heads)
    executor = Executor(registry=registry, weight_dtype=torch.float32)  # [dcp 5/12]
    plans = PlanPrefetcher(client, epoch_id=epoch_id, rank=rank, num_steps=num_steps)  # [dcp 6/12]
    loaded: dict[str, dict[str, torch.Tensor]] = {}

    def load_sample(sample: Sample) -> dict[str, torch.Tensor]:  # [dcp 7/12]
        loaded[sample.id] = load(sample, args.seed)
        return loaded[sample.id]

    for step in range(steps):
        rank_plan = plans.get(step)  # [dcp 8/12]
        executor.begin_step(rank_plan, step=step)  # [dcp 9/12]
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros(())
        for work in executor.micro_batches(rank_plan, load_sample=load_sample):  # [dcp 10/12]
            items = [loaded.pop(i) for i in work.sample_ids]
            pred = hf_wan.forward(model, work, videos=[it["video"] for it in items],  # [dcp 11/12]
                                  timesteps=torch.cat([it["timestep"] for it in items]),
                                  texts=torch.stack([it["text"] for it in items]))
            loss = work.loss(hf_wan.token_losses(pred, work.targets))  # [dcp 12/12]
            loss.backward()
            step_loss += loss.detach()
        executor.sync_gradients(model)
        optimizer.step()
        dist.all_reduce(step_loss)
        if rank == 0:
            rings = rank_plan.ring_degrees or [1] * len(rank_plan.group_sizes)
            print(f"step {step}: loss {step_loss.item():.4f} group sizes {rank_plan.group_sizes} ring degrees {rings} "
                  f"digest {rank_plan.plan_digest[:12]}", flush=True)
    plans.close()
    client.close()
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {steps} steps of epoch {epoch_id} on {world} ranks")


if __name__ == "__main__":
    main()
