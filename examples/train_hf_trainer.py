"""Fine-tune a small Llama with the Hugging Face ``Trainer`` under DCP plans (CPU, gloo).

Run (needs ``pip install -e '.[hf]'``)::

    torchrun --nproc-per-node 4 examples/train_hf_trainer.py                    # plans made locally
    torchrun --nproc-per-node 4 examples/train_hf_trainer.py --service --url http://127.0.0.1:8000

An ordinary ``Trainer`` script: a random-initialised ``LlamaForCausalLM`` built from a config (no
download), the documents of ``examples/data/hf_trainer_docs.jsonl`` tokenized as UTF-8 bytes,
``TrainingArguments`` with logging, a linear schedule, checkpoints and an evaluation every 2 steps on
the first 8 documents (the ``Trainer``'s own loop: DCPTrainer pads them itself when the script gives
no ``data_collator``). The lines marked ``# [dcp]``
are what DCP adds: the manifest of the dataset, where plans come from, and ``DCPTrainer`` in place of
``Trainer``. With ``--service`` (plans from ``dcp serve`` at ``--url``) rank 0 also starts the epoch
job on the service (in production an operator does that once) and every rank posts its measured
step times to it.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import _tight_memory, parse_args

from costmodel.analytic import analytic_cost_model
from costmodel.presets import load_cluster
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from executor.client import PlannerClient
from executor.integrations.hf_trainer import DCPTrainer  # [dcp]
from executor.integrations.hf_trainer_data import LocalPlans, ServicePlans, manifest  # [dcp]
from planner.epoch import BatchRule, StepTask, make_steps, plan_step
from planner.plan import Plan

DATA = Path(__file__).resolve().parent / "data" / "hf_trainer_docs.jsonl"
OPTIONS = {"time_limit_s": 2.0, "use_cpsat": False, "layout": "ulysses"}
"""Planner options: quick and deterministic, so every rank plans the same step alike; pure Ulysses
(named: the planner's default is ``auto``), since planning locally the trainer builds its process
groups by group size, with no epoch to declare ring layouts."""


def load_documents(path: Path = DATA) -> list[dict[str, Any]]:
    """The JSONL documents tokenized as UTF-8 bytes (vocabulary 256)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": row["id"], "input_ids": list(row["text"].encode())} for row in rows]


def cluster_and_cost_model(config: LlamaConfig, *, world_size: int, memory_tokens: int
                           ) -> tuple[ClusterSpec, CostModelFile]:
    """A CPU 'cluster' of the world size and the analytic cost model of the model trained."""
    spec = ModelSpec(name="hf-trainer-llama-tiny", kind="1d", num_layers=config.num_hidden_layers,
                     hidden=config.hidden_size, num_heads=config.num_attention_heads,
                     ffn_hidden=config.intermediate_size, vocab=config.vocab_size, causal=True)
    cluster = load_cluster("h200x8").model_copy(update={
        "name": f"cpu{world_size}", "num_gpus": world_size, "gpus_per_node": world_size})
    if memory_tokens > 0:
        cluster = _tight_memory(cluster, analytic_cost_model(spec, cluster.hardware), tokens=memory_tokens)
    return cluster, analytic_cost_model(spec, cluster.hardware)


def local_planner(samples: list[Sample], *, cluster: ClusterSpec, cost_model: CostModelFile,
                  samples_per_step: int, seed: int) -> tuple[Any, int]:
    """``step -> Plan`` with the planner library, the inputs and seeds a service epoch would use."""
    steps = make_steps(samples, rule=BatchRule(samples_per_step=samples_per_step), seed=seed)

    def plan_for_step(step: int) -> Plan:
        task = StepTask.create(step=step, samples=steps[step], cluster=cluster, cost_model=cost_model,
                               options=OPTIONS, seed=seed)
        return Plan.model_validate_json(plan_step(task).plan_json)

    return plan_for_step, len(steps)


def start_service_epoch(client: PlannerClient, *, epoch_id: str, samples: list[Sample], cluster: ClusterSpec,
                        cost_model: CostModelFile, samples_per_step: int, seed: int) -> None:
    """On rank 0: upload the cost model and start the epoch job (every rank then waits)."""
    if dist.get_rank() == 0:
        client.request("POST", "/v1/cost-models", json=cost_model.model_dump(mode="json"))
        client.start_epoch({
            "epoch_id": epoch_id, "seed": seed, "batch": {"samples_per_step": samples_per_step},
            "manifest_jsonl": "\n".join(s.model_dump_json(exclude_none=True) for s in samples),
            "cluster": cluster.model_dump(mode="json"), "cost_model_id": cost_model.id, "options": OPTIONS})
    dist.barrier()


def main() -> None:
    """Train ``--steps`` optimizer steps and print each step's logged loss."""
    args = parse_args(__doc__ or "", extra=[("--output-dir", {"default": "runs/hf-trainer"}),
                                            ("--service", {"action": "store_true",
                                                          "help": "Fetch plans from --url."})])
    local = not args.service
    torch.set_num_threads(1)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="linear",
        logging_steps=1, save_steps=2, save_strategy="steps", eval_strategy="steps", eval_steps=2,
        per_device_eval_batch_size=2, use_cpu=True, ddp_backend="gloo",
        report_to=[], seed=args.seed, disable_tqdm=True)
    rank, world = training_args.process_index, training_args.world_size  # initialises torch.distributed
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    dataset = load_documents()

    samples = manifest(dataset, id_column="id")  # [dcp]
    cluster, cost_model = cluster_and_cost_model(config, world_size=world, memory_tokens=args.memory_tokens)
    if local:  # [dcp] plans made in each rank (the same on every rank) ...
        plan_for_step, num_steps = local_planner(samples, cluster=cluster, cost_model=cost_model,
                                                 samples_per_step=args.samples_per_step, seed=args.seed)
        plans: LocalPlans | ServicePlans = LocalPlans(plan_for_step, num_steps=num_steps, rank=rank)
    else:  # [dcp] ... or fetched from the service
        client = PlannerClient(args.url)
        epoch_id = args.epoch_id or "hf-trainer-example"
        start_service_epoch(client, epoch_id=epoch_id, samples=samples, cluster=cluster, cost_model=cost_model,
                            samples_per_step=args.samples_per_step, seed=args.seed)
        plans = ServicePlans(client, epoch_id=epoch_id, rank=rank)
    trainer = DCPTrainer(model=model, args=training_args, train_dataset=dataset,  # [dcp] was Trainer(
                         eval_dataset=dataset[:8], plans=plans, id_column="id")  # [dcp]
    trainer.train()

    if rank == 0:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step'] - 1}: loss {entry['loss']:.4f}", flush=True)
            if "eval_loss" in entry:
                print(f"eval after step {entry['step'] - 1}: eval_loss {entry['eval_loss']:.4f}", flush=True)
        print(f"done: {trainer.state.global_step} steps on {world} ranks "
              f"({'local' if local else 'service'} plans)", flush=True)
    shut_down(plans)


def shut_down(plans: LocalPlans | ServicePlans) -> None:
    """Close the plan client and tear down the process group the Trainer initialised.

    Left to interpreter exit, the gloo group's threads are sometimes destroyed while joinable: a SIGABRT
    ("terminate called without an active exception") after a complete run, seen in CI.
    """
    if isinstance(plans, ServicePlans):
        plans.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
