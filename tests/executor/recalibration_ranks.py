"""The training ranks of the recalibration end-to-end test (spawned; gloo on loopback).

Each rank trains a reference model (LLaMA-style 1D or STDiT-style 2D) on plans fetched from the service, times its
micro-batches (``executor.measure``) and posts them in the background. Phase A runs the first
``steps_a`` steps; then every rank flushes its measurements and rank 0 waits until the service
has published a revision and re-planned the unfetched steps; phase B runs the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from executor.client import PlannerClient, RetryPolicy
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.measured_steps import MeasuredSteps
from executor.models import Llama1D, STDiT2D
from executor.runtime import MicroBatchWork
from tests.executor.helpers import CONFIG, build_model, init_gloo


def worker(rank: int, world: int, port: int, url: str, epoch_id: str, samples_json: str, steps_a: int,
           steps_b: int, out: str, kind: str = "1d") -> None:
    """One rank of the ``kind`` reference model: phase A, wait for the revision, phase B; writes
    what it fetched."""
    init_gloo(rank, world, port)
    from costmodel.specs import Sample

    samples = [Sample.model_validate(s) for s in json.loads(samples_json)]
    dataset = SyntheticDataset(samples, kind=kind, vocab=CONFIG.vocab, channels=CONFIG.in_channels, seed=1,
                               dtype=torch.float32)
    model = build_model(kind, dtype=torch.float32)
    token_losses = Llama1D.token_losses if kind == "1d" else STDiT2D.token_losses
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    client = PlannerClient(url, retry=RetryPolicy(deadline_s=60))
    loop = MeasuredSteps(client, rank=rank, registry=GroupRegistry(world_size=world, rank=rank,
                                                                   group_sizes=[d for d in (1, 2, 4) if d <= world]))

    def loss(work: MicroBatchWork) -> torch.Tensor:
        logits = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
        return work.loss(token_losses(logits, work.targets))

    def run(steps: range) -> None:
        loop.run(epoch_id, steps, model=model, optimizer=optimizer, load_sample=dataset.load, loss=loss,
                 close_timeout_s=30)

    run(range(steps_a))
    dist.barrier()
    if rank == 0:  # the service recalibrates and re-plans the steps nobody fetched yet
        client.wait_for_revision(epoch_id, timeout_s=60, poll_s=0.1)
    dist.barrier()
    run(range(steps_a, steps_a + steps_b))
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "fetched": loop.fetched[epoch_id], "posted": loop.num_posted_steps, "dropped": loop.num_dropped_steps}))
    client.close()
    dist.destroy_process_group()
