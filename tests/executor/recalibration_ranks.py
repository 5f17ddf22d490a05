"""The training ranks of the recalibration end-to-end test (spawned; gloo on loopback).

Each rank trains the reference LLaMA-style model on plans fetched from the service, times its
micro-batches (``executor.measure``) and posts them in the background. Phase A runs the first
``steps_a`` steps; then every rank flushes its measurements and rank 0 waits until the service
has published a revision and re-planned the unfetched steps; phase B runs the rest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from executor.client import PlannerClient, RetryPolicy
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.measure import MeasurementReporter, ReporterConfig, StepMeasurement, StepTimer
from executor.models import Llama1D
from executor.runtime import Executor
from tests.executor.helpers import CONFIG, build_model, init_gloo

WORLD = 2


def worker(rank: int, port: int, url: str, epoch_id: str, samples_json: str, steps_a: int, steps_b: int,
           out: str) -> None:
    """One rank: phase A, wait for the revision, phase B; writes what it fetched."""
    init_gloo(rank, WORLD, port)
    from costmodel.specs import Sample

    samples = [Sample.model_validate(s) for s in json.loads(samples_json)]
    dataset = SyntheticDataset(samples, kind="1d", vocab=CONFIG.vocab, seed=1, dtype=torch.float32)
    model = build_model("1d", dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    client = PlannerClient(url, retry=RetryPolicy(deadline_s=60))
    registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2])
    reporters: list[MeasurementReporter] = []

    def sink(m: StepMeasurement) -> None:
        reporters[-1].submit(m)

    timer = StepTimer(rank=rank, sink=sink)
    executor = Executor(registry=registry, weight_dtype=torch.float32, timer=timer)
    config = ReporterConfig(batch_steps=4, flush_interval_s=0.5)
    fetched: dict[int, str] = {}

    def run(steps: range) -> None:
        for step in steps:
            rank_plan = client.rank_plan(epoch_id, step, rank)
            fetched[step] = rank_plan.plan_digest
            executor.begin_step(rank_plan, step=step)
            optimizer.zero_grad(set_to_none=True)
            for work in executor.micro_batches(rank_plan, load_sample=dataset.load):
                logits = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
                work.loss(Llama1D.token_losses(logits, work.targets)).backward()
            executor.sync_gradients(model)
            optimizer.step()
        timer.flush()
        reporters[-1].close(timeout_s=30)

    reporters.append(MeasurementReporter(client, epoch_id=epoch_id, rank=rank, config=config))
    run(range(steps_a))
    dist.barrier()
    if rank == 0:  # the service recalibrates and re-plans the steps nobody fetched yet
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            report = httpx.get(f"{url}/v1/epochs/{epoch_id}/recalibration", timeout=10).json()
            if report["revisions"] and not report["busy"]:
                break
            time.sleep(0.1)
    dist.barrier()
    reporters.append(MeasurementReporter(client, epoch_id=epoch_id, rank=rank, config=config))
    run(range(steps_a, steps_a + steps_b))
    posted = sum(r.num_posted_steps for r in reporters)
    dropped = sum(r.num_dropped_steps for r in reporters)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"fetched": fetched, "posted": posted,
                                                         "dropped": dropped}))
    client.close()
    dist.destroy_process_group()
