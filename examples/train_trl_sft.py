"""Supervised fine-tuning of a small Llama with TRL's ``SFTTrainer`` under DCP plans (CPU, gloo).

Run (needs ``pip install -e '.[hf,trl]'``)::

    torchrun --nproc-per-node 4 examples/train_trl_sft.py                    # plans made locally
    torchrun --nproc-per-node 4 examples/train_trl_sft.py --service --url http://127.0.0.1:8000

An ordinary TRL script: a random-initialised ``LlamaForCausalLM`` built from a config (no download),
the documents of ``examples/data/hf_trainer_docs.jsonl`` tokenized as UTF-8 bytes with the first
``--prompt-tokens`` of each masked out of the loss (completion-only labels), ``SFTConfig`` with
``packing=True``, logging and a linear schedule. The lines marked ``# [dcp]`` are what DCP adds: the
manifest of the dataset, where plans come from, and ``DCPSFTTrainer`` in place of ``SFTTrainer``
(the plans pack each micro-batch, so TRL's own packing is left to them). With ``--service`` rank 0
also starts the epoch job on the service, as in ``examples/train_hf_trainer.py``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM
from trl import SFTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_args
from train_hf_trainer import cluster_and_cost_model, load_documents, local_planner, shut_down, start_service_epoch

from executor.client import PlannerClient
from executor.integrations.hf_trainer import dcp_sft_trainer_class  # [dcp]
from executor.integrations.hf_trainer_data import LocalPlans, ServicePlans, manifest  # [dcp]


def main() -> None:
    """Train ``--steps`` optimizer steps and print each step's logged loss."""
    args = parse_args(__doc__ or "", extra=[("--output-dir", {"default": "runs/trl-sft"}),
                                            ("--prompt-tokens", {"type": int, "default": 6,
                                                                 "help": "Leading tokens without loss."}),
                                            ("--service", {"action": "store_true",
                                                          "help": "Fetch plans from --url."})])
    torch.set_num_threads(1)
    sft_config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", packing=True, max_length=1024, use_cpu=True, ddp_backend="gloo",
        report_to=[], seed=args.seed, disable_tqdm=True)
    rank, world = sft_config.process_index, sft_config.world_size  # initialises torch.distributed
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    tokenizer = ByT5Tokenizer()  # byte-level, no download: only its pad and eos tokens are used
    rows = [{**d, "labels": [-100] * args.prompt_tokens + d["input_ids"][args.prompt_tokens:]}
            for d in load_documents()]
    dataset = Dataset.from_list(rows)

    samples = manifest(rows, id_column="id")  # [dcp]
    cluster, cost_model = cluster_and_cost_model(config, world_size=world, memory_tokens=args.memory_tokens)
    if not args.service:  # [dcp] plans made in each rank (the same on every rank) ...
        plan_for_step, num_steps = local_planner(samples, cluster=cluster, cost_model=cost_model,
                                                 samples_per_step=args.samples_per_step, seed=args.seed)
        plans: LocalPlans | ServicePlans = LocalPlans(plan_for_step, num_steps=num_steps, rank=rank)
    else:  # [dcp] ... or fetched from the service
        client = PlannerClient(args.url)
        epoch_id = args.epoch_id or "trl-sft-example"
        start_service_epoch(client, epoch_id=epoch_id, samples=samples, cluster=cluster, cost_model=cost_model,
                            samples_per_step=args.samples_per_step, seed=args.seed)
        plans = ServicePlans(client, epoch_id=epoch_id, rank=rank)
    trainer = dcp_sft_trainer_class()(  # [dcp] was SFTTrainer(
        model=model, args=sft_config, train_dataset=dataset, processing_class=tokenizer,
        plans=plans, id_column="id")  # [dcp]
    trainer.train()

    if rank == 0:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step'] - 1}: loss {entry['loss']:.4f}", flush=True)
        print(f"done: {trainer.state.global_step} steps on {world} ranks "
              f"({'service' if args.service else 'local'} plans)", flush=True)
    shut_down(plans)


if __name__ == "__main__":
    main()
