"""Shared set-up of the example training scripts (not part of the executor integration).

In production an operator starts the epoch job once (``POST /v1/epochs``, or ``dcp epoch``
offline into the store the service serves); the examples do it from rank 0 so that one
command shows the whole loop: derive an analytic cost model of the reference model actually
trained (so that checkpoint policies ``0..L`` refer to its layers), upload it, and start an
epoch job for a CPU "cluster" of the world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from executor.client import PlannerClient
from executor.models import ModelConfig

logger = logging.getLogger(__name__)


def parse_args(description: str, *,
               extra: Sequence[tuple[str, dict[str, Any]]] = ()) -> argparse.Namespace:
    """Command-line options shared by the examples, plus ``extra`` ``(flag, add_argument kwargs)``."""
    parser = argparse.ArgumentParser(description=description)
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="Planner service URL.")
    parser.add_argument("--epoch-id", default=None, help="Epoch job id (default: generated).")
    parser.add_argument("--steps", type=int, default=4, help="Optimizer steps to run.")
    parser.add_argument("--samples-per-step", type=int, default=8, help="Global batch size.")
    parser.add_argument("--num-samples", type=int, default=64, help="Samples in the manifest.")
    parser.add_argument("--seed", type=int, default=0, help="Data and shuffle seed.")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="Plan fetch deadline.")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate.")
    parser.add_argument("--memory-tokens", type=int, default=96,
                        help="Shrink the simulated device memory so that a sample of about this "
                             "many tokens fills one rank without checkpointing (forces SP groups "
                             "and checkpoint policies on tiny CPU models; 0 = real H200 memory).")
    return parser.parse_args()


def model_spec(config: ModelConfig, *, kind: str, name: str) -> ModelSpec:
    """The cost model's view of a reference model."""
    return ModelSpec(name=name, kind=kind, num_layers=config.num_layers,  # type: ignore[arg-type]
                     hidden=config.hidden, num_heads=config.num_heads, ffn_hidden=config.ffn_hidden,
                     vocab=config.vocab if kind == "1d" else 0, causal=kind == "1d")


def manifest(kind: str, *, num_samples: int, seed: int) -> list[Sample]:
    """A synthetic long-tailed manifest of tiny samples (CPU-sized)."""
    rng = random.Random(seed)
    samples = []
    for i in range(num_samples):
        if kind == "1d":
            samples.append(Sample(id=f"doc-{i}", tokens=int(8 + rng.paretovariate(1.2) * 12) % 400 + 8))
        else:
            f, h, w = rng.choice([1, 2, 4, 8]), rng.choice([2, 4, 6]), rng.choice([2, 4, 6])
            samples.append(Sample(id=f"clip-{i}", tokens=f * h * w, frames=f, height=h, width=w))
    return samples


def _tight_memory(cluster: ClusterSpec, cost_model: CostModelFile, *, tokens: int) -> ClusterSpec:
    """The cluster with device memory cut so that ``tokens`` tokens fill a rank's budget."""
    model = CostModel(file=cost_model, cluster=cluster)
    need = model.fixed_bytes() + float(model.activation_bytes(tokens, group_size=1))
    hbm = need / cluster.memory_cap_fraction
    hardware = cluster.hardware.model_copy(update={"name": f"{cluster.hardware.name}-tight", "hbm_bytes": hbm})
    return cluster.model_copy(update={"hardware": hardware, "name": f"{cluster.name}-tight"})


def start_epoch(client: PlannerClient, *, spec: ModelSpec, samples: list[Sample], world_size: int,
                args: argparse.Namespace) -> tuple[str, int]:
    """On rank 0: upload the cost model and start the epoch job; every rank: learn its id.

    Returns:
        ``(epoch_id, steps_total)``.
    """
    epoch_id = args.epoch_id or f"example-{spec.kind}-{int(time.time())}"
    info = [epoch_id, 0]
    if dist.get_rank() == 0:
        cluster = load_cluster("h200x8").model_copy(update={
            "name": f"cpu{world_size}", "num_gpus": world_size, "gpus_per_node": world_size})
        if args.memory_tokens > 0:
            cluster = _tight_memory(cluster, analytic_cost_model(spec, cluster.hardware),
                                    tokens=args.memory_tokens)
        cost_model = analytic_cost_model(spec, cluster.hardware)
        client.request("POST", "/v1/cost-models", json=cost_model.model_dump(mode="json"))
        status = client.start_epoch({
            "epoch_id": epoch_id,
            "manifest_jsonl": "\n".join(json.dumps(s.model_dump(exclude_none=True)) for s in samples),
            "batch": {"samples_per_step": args.samples_per_step}, "seed": args.seed,
            "cluster": cluster.model_dump(mode="json"), "cost_model_id": cost_model.id,
            "options": {"time_limit_s": 0.5, "layout": getattr(args, "layout", "ulysses")}})
        info = [status["epoch_id"], status["steps_total"]]
        logger.info("started epoch %s: %d steps", info[0], info[1])
    dist.broadcast_object_list(info, src=0)
    return str(info[0]), int(info[1])
