"""What every rank of the Trainer equivalence test runs (one torchrun of 4 ranks for every check).

Runs, on the documents of ``examples/data/hf_trainer_docs.jsonl`` with the example's tiny Llama
in fp64:

1. ``plain``: ``transformers.Trainer`` itself, data parallel (accelerate's DDP, sequential
   sampling, right padding, the causal LM loss over ``num_items_in_batch`` gathered over the
   processes) on the global batches of the service's plans (each step's samples split 2 per
   rank). The loss is given as ``compute_loss_func``: the model's own casts the logits to fp32;
   this is the same loss kept in fp64;
   With an eval set (the first ``EVAL_DOCS`` documents): ``eval_strategy='steps'`` every 2 steps and
   a ``trainer.evaluate()`` after training;
2. ``dcp``: :class:`DCPTrainer` with the service's plans, checkpoints at steps 2 and 4, the same
   evaluations (its default eval collator, the same fp64 loss function);
3. ``resumed``: a differently initialised model, resumed by the ``Trainer`` from ``checkpoint-2``;
4. ``local``: :class:`DCPTrainer` with plans made in each rank by the planner library;
7. ``fsdp2``: the model sharded with FSDP2 at load (``from_pretrained(distributed_config=
   DistributedConfig(fsdp_size=4))``, the ``Trainer``'s FSDP2 path that runs on CPU: accelerate keeps
   its FSDP plugin for GPU distributed types only) under the plain ``Trainer`` and under
   :class:`DCPTrainer` with the service's plans; parameters gathered whole after the 4 steps;
6. ``titan``: ``executor/integrations/torchtitan.py`` on a decoder with torchtitan's calling
   convention under the executor's scenario plans (torchtitan itself needs a GPU);
5. ``sft`` (when ``trl`` is installed): TRL's ``SFTTrainer`` padding-free (each rank's batch packed
   into one sequence, the same fp64 loss) and ``DCPSFTTrainer`` with ``packing=True``, 3 steps,
   completion-only labels (each document's first 6 tokens are -100); ``DCPSFTTrainer`` resumed from
   its ``checkpoint-2`` into a differently initialised model (step 2 again);
8. ``ring``: a second epoch of the same documents served with ``layout="ring"``: the plain ``Trainer``
   on its global batches and :class:`DCPTrainer` with its plans (groups from the declared layouts), 3 steps.

Each run records its per-rank loss values and (rank 0) its final parameters into ``rank{r}.pt``.
Usage: ``torchrun --nproc-per-node 4 hf_trainer_worker.py URL EPOCH_ID OUT_DIR``.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

STEPS = 4
SAMPLES_PER_STEP = 8
SFT_STEPS = 3
RING_STEPS = 3
PROMPT_TOKENS = 6
EVAL_DOCS = 10
EVAL = {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2}
"""Evaluation of the plain and dcp runs: 10 rows over 4 ranks (the sampler repeats 2 rows; 2 batches a rank)."""
SEED = 0


def _model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attention_dropout=0.0)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(torch.float64)


def _args(out: Path, **extra: Any) -> Any:
    from transformers import TrainingArguments

    base: dict[str, Any] = {"max_steps": STEPS, "learning_rate": 1e-2, "lr_scheduler_type": "linear",
                            "logging_steps": 1, "use_cpu": True, "ddp_backend": "gloo", "report_to": [],
                            "seed": SEED, "disable_tqdm": True, "save_strategy": "no", "max_grad_norm": 1.0}
    return TrainingArguments(output_dir=str(out), **{**base, **extra})


def _pad(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right padding: ids 0, labels -100, attention mask 0."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = ids[i, :n]
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _causal_lm_loss_fp64(outputs: Any, labels: torch.Tensor, *, num_items_in_batch: Any = None) -> torch.Tensor:
    """``transformers``' ``ForCausalLMLoss`` without its cast of the logits to fp32
    (``transformers/loss/loss_utils.py``): shifted labels, summed cross-entropy over the targets
    that are not -100, divided by the Trainer's ``num_items_in_batch`` (in evaluation, which passes
    none: by the batch's own targets, the mean ``ForCausalLMLoss`` takes then)."""
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    losses = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    if num_items_in_batch is None:
        return losses / (targets != -100).sum()
    return losses / num_items_in_batch


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    """The model's parameters, whole (an FSDP2 shard is gathered: a collective, every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters()}


def _evals(trainer: Any) -> dict[str, Any]:
    """The evaluations logged during training (step, eval loss) and one ``evaluate()`` after it."""
    during = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    return {"during": during, "final": trainer.evaluate()}


def _plain(out: Path, docs: list[dict[str, Any]], batches: list[list[str]], world: int, *,
           steps: int = STEPS, evaluate: bool = True) -> dict[str, Any]:
    from transformers import Trainer

    class Recording(Trainer):
        """The Trainer unchanged, its per-rank loss values kept in fp64."""

        losses: ClassVar[list[float]] = []

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    by_id = {d["id"]: d for d in docs}
    ordered = [by_id[i] for batch in batches for i in batch]  # step s = rows 8s..8s+7, 2 per rank
    trainer = Recording(model=_model(SEED), args=_args(out / "plain", train_sampling_strategy="sequential",
                                                       per_device_train_batch_size=SAMPLES_PER_STEP // world,
                                                       max_steps=steps, **(EVAL if evaluate else {})),
                        train_dataset=ordered, eval_dataset=docs[:EVAL_DOCS] if evaluate else None,
                        data_collator=_pad, compute_loss_func=_causal_lm_loss_fp64)
    trainer.train()
    return {"losses": list(trainer.losses), "params": _params(trainer),
            "evals": _evals(trainer) if evaluate else None}


def _dcp(out: Path, docs: list[dict[str, Any]], plans: Any, *, seed: int = SEED,
         resume: str | None = None, save: bool = False, evaluate: bool = False) -> dict[str, Any]:
    from executor.integrations.hf_trainer import DCPTrainer

    extra: dict[str, Any] = {"save_strategy": "steps", "save_steps": 2} if save or resume else {}
    evals: dict[str, Any] = {"eval_dataset": docs[:EVAL_DOCS], "compute_loss_func": _causal_lm_loss_fp64}
    trainer = DCPTrainer(model=_model(seed), args=_args(out, **extra, **(EVAL if evaluate else {})),
                         train_dataset=docs, plans=plans, id_column="id", **(evals if evaluate else {}))
    trainer.train(resume_from_checkpoint=resume)
    return {"history": list(trainer.dcp_history), "params": _params(trainer),
            "global_step": trainer.state.global_step,
            "logged": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "evals": _evals(trainer) if evaluate else None, "after_eval": _dcp_state(trainer.model)}


def _dcp_state(model: Any) -> dict[str, Any]:
    """The model's attention and how many decoder layers run DCP's checkpoint policies (after evaluation
    switched them off and back on)."""
    from executor.integrations import hf_transformers as hf

    return {"attention": model.config._attn_implementation,
            "policy_layers": sum("forward" in layer.__dict__ for layer in hf.decoder_layers(model)),
            "layers": len(hf.decoder_layers(model))}


def _fsdp2(out: Path, docs: list[dict[str, Any]], batches: list[list[str]], plans: Any,
           world: int) -> dict[str, Any]:
    """The plain ``Trainer`` and ``DCPTrainer`` on a model sharded by FSDP2 at load time (the
    ``_model(SEED)`` weights saved by rank 0, loaded by every rank with ``DistributedConfig``)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, Trainer
    from transformers.distributed import DistributedConfig

    from executor.integrations.hf_trainer import DCPTrainer

    saved = out / "fsdp2_init"
    if dist.get_rank() == 0:
        _model(SEED).save_pretrained(saved)
    dist.barrier()

    def sharded() -> Any:
        return LlamaForCausalLM.from_pretrained(saved, distributed_config=DistributedConfig(fsdp_size=world),
                                                dtype=torch.float64, attn_implementation="sdpa")

    by_id = {d["id"]: d for d in docs}
    ordered = [by_id[i] for batch in batches for i in batch]
    plain = Trainer(model=sharded(), args=_args(out / "fsdp2_plain", train_sampling_strategy="sequential",
                                                per_device_train_batch_size=SAMPLES_PER_STEP // world),
                    train_dataset=ordered, data_collator=_pad, compute_loss_func=_causal_lm_loss_fp64)
    plain.train()
    dcp = DCPTrainer(model=sharded(), args=_args(out / "fsdp2_dcp"), train_dataset=docs, plans=plans, id_column="id")
    dcp.train()
    executor = dcp._dcp_executor
    return {"plain_params": _params(plain), "params": _params(dcp), "history": list(dcp.dcp_history),
            "sync": type(executor.grad_sync).__name__ if executor is not None else None,
            "plain_logged": [e["loss"] for e in plain.state.log_history if "loss" in e],
            "logged": [e["loss"] for e in dcp.state.log_history if "loss" in e]}


def _sft_args(out: Path, *, packing: bool, padding_free: bool, **extra: Any) -> Any:
    from trl import SFTConfig

    base = _args(out).to_dict()
    base.update({"max_steps": SFT_STEPS, "max_length": 1024, "packing": packing, "padding_free": padding_free,
                 **extra})
    return SFTConfig(**{k: v for k, v in base.items() if k not in ("hub_token", "push_to_hub_token")})


def _sft(out: Path, docs: list[dict[str, Any]], batches: list[list[str]], plans: Any, resume_plans: Any,
         world: int) -> dict[str, Any]:
    """TRL's SFTTrainer, padding-free (each rank's batch packed into one sequence), and DCPSFTTrainer
    with ``packing=True`` (the plans pack), on a ``datasets.Dataset`` of the same documents; then
    ``DCPSFTTrainer`` on a differently initialised model resumed from its ``checkpoint-2``."""
    from datasets import Dataset
    from transformers import ByT5Tokenizer
    from trl import SFTTrainer

    from executor.integrations.hf_trainer import dcp_sft_trainer_class

    tokenizer = ByT5Tokenizer()  # byte-level, no download: only its pad and eos tokens are used
    # completion-only loss: the first PROMPT_TOKENS bytes of every document are a "prompt" (label -100)
    docs = [{**d, "labels": [-100] * PROMPT_TOKENS + d["input_ids"][PROMPT_TOKENS:]} for d in docs]
    by_id = {d["id"]: d for d in docs}
    ordered = Dataset.from_list([by_id[i] for batch in batches[:SFT_STEPS] for i in batch])
    class RecordingSFT(SFTTrainer):
        """TRL's SFTTrainer unchanged, its per-rank loss values kept in fp64."""

        losses: ClassVar[list[float]] = []

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses.append(float(loss))
            return loss

    plain = RecordingSFT(model=_model(SEED), args=_sft_args(out / "sft_plain", packing=False, padding_free=True,
                                                          max_length=None,  # TRL: not enforced padding-free
                                                          train_sampling_strategy="sequential",
                                                          per_device_train_batch_size=SAMPLES_PER_STEP // world),
                       train_dataset=ordered, processing_class=tokenizer, compute_loss_func=_causal_lm_loss_fp64)
    plain.train()
    dcp_sft = dcp_sft_trainer_class()

    def dcp_run(seed: int, served: Any, resume: str | None = None) -> Any:
        trainer = dcp_sft(model=_model(seed), args=_sft_args(out / "sft_dcp", packing=True, padding_free=False,
                                                             save_strategy="steps", save_steps=2),
                          train_dataset=Dataset.from_list(docs), processing_class=tokenizer, plans=served,
                          id_column="id")
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    dcp = dcp_run(SEED, plans)
    # a differently initialised model resumed from the run's step-2 checkpoint: the last step's plan again
    resumed = dcp_run(SEED + 1, resume_plans, resume=str(out / "sft_dcp" / "checkpoint-2"))
    return {"plain_losses": list(plain.losses), "plain_params": _params(plain), "params": _params(dcp),
            "history": list(dcp.dcp_history), "resumed_history": list(resumed.dcp_history),
            "resumed_params": _params(resumed),
            "plain_logged": [e["loss"] for e in plain.state.log_history if "loss" in e],
            "logged": [e["loss"] for e in dcp.state.log_history if "loss" in e]}


def _ring(out: Path, docs: list[dict[str, Any]], client: Any, *, epoch_id: str, rank: int, world: int,
          samples: Any, cluster: Any, cost_model: Any) -> dict[str, Any]:
    """A ``layout="ring"`` epoch of the same documents (rank 0 starts it; the cost model is uploaded):
    the plain ``Trainer`` on its global batches and :class:`DCPTrainer` with its plans, groups from the
    epoch's declared layouts (``ServicePlans.layouts``), ``RING_STEPS`` steps."""
    import torch.distributed as dist
    from train_hf_trainer import OPTIONS

    from executor.integrations.hf_trainer import DCPTrainer
    from executor.integrations.hf_trainer_data import ServicePlans

    if rank == 0:
        client.start_epoch({
            "epoch_id": epoch_id, "seed": SEED, "batch": {"samples_per_step": SAMPLES_PER_STEP},
            "manifest_jsonl": "\n".join(x.model_dump_json(exclude_none=True) for x in samples),
            "cluster": cluster.model_dump(mode="json"), "cost_model_id": cost_model.id,
            "options": {**OPTIONS, "layout": "ring"}})
    dist.barrier()
    plans = [client.step_plan(epoch_id, s)[0] for s in range(RING_STEPS)]
    plain = _plain(out / "ring", docs, [sorted(p.sample_ids) for p in plans], world, steps=RING_STEPS,
                   evaluate=False)
    served = ServicePlans(client, epoch_id=epoch_id, rank=rank, report=False)
    trainer = DCPTrainer(model=_model(SEED), args=_args(out / "ring_dcp", max_steps=RING_STEPS), train_dataset=docs,
                         plans=served, id_column="id")
    trainer.train()
    served.close()
    return {"layouts": served.layouts, "plan_layouts": [[(g.size, g.ulysses_degree, g.ring_degree) for g in p.groups]
                                                         for p in plans],
            "registry_sizes": list(trainer.dcp_registry.sizes),
            "plain_losses": plain["losses"], "plain_params": plain["params"], "params": _params(trainer),
            "history": list(trainer.dcp_history)}


def _titan(rank: int, world: int) -> dict[str, Any]:
    """``executor.integrations.torchtitan`` on a decoder with torchtitan's calling convention
    (``titan_standin``), under the executor's scenario plans (groups 2+1+1, 4, 1+2+1)."""
    from executor.groups import GroupRegistry
    from executor.integrations import torchtitan as tt
    from executor.runtime import Executor
    from tests.executor import scenarios
    from tests.executor.integrations import titan_standin

    registry = GroupRegistry(world_size=world, rank=rank, group_sizes=[1, 2, 4])
    executor = Executor(registry=registry)
    model = titan_standin.build()
    out: dict[str, Any] = {"swapped": tt.install(model, group_sizes=registry.sizes)}
    for i, plan in enumerate(scenarios.plans_1d()):
        model.zero_grad(set_to_none=True)
        out[f"loss_{i}"] = titan_standin.run_step(executor, model, plan)
        out[f"grad_{i}"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


def run(url: str, epoch_id: str, out: Path) -> dict[str, Any]:
    """Every run of the module docstring on this rank."""
    from train_hf_trainer import cluster_and_cost_model, load_documents, local_planner, start_service_epoch
    from transformers import LlamaConfig

    from executor.client import PlannerClient
    from executor.integrations.hf_trainer_data import LocalPlans, ServicePlans, manifest

    args = _args(out / "probe")
    rank, world = args.process_index, args.world_size  # initialises torch.distributed (gloo)
    docs = load_documents()
    samples = manifest(docs, id_column="id")
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    cluster, cost_model = cluster_and_cost_model(config, world_size=world, memory_tokens=96)
    client = PlannerClient(url)
    start_service_epoch(client, epoch_id=epoch_id, samples=samples, cluster=cluster, cost_model=cost_model,
                        samples_per_step=SAMPLES_PER_STEP, seed=SEED)
    results: dict[str, Any] = {"rank": rank}
    plans = [client.step_plan(epoch_id, s)[0] for s in range(STEPS)]
    results["service_digests"] = [p.digest() for p in plans]
    results["group_sizes"] = [[g.size for g in p.groups] for p in plans]
    results["titan"] = _titan(rank, world)
    results["plain"] = _plain(out, docs, [sorted(p.sample_ids) for p in plans], world)

    served = ServicePlans(client, epoch_id=epoch_id, rank=rank)
    results["dcp"] = _dcp(out / "dcp", docs, served, save=True, evaluate=True)
    served.close()
    again = ServicePlans(client, epoch_id=epoch_id, rank=rank)
    results["resumed"] = _dcp(out / "dcp", docs, again, seed=SEED + 1,
                              resume=str(out / "dcp" / "checkpoint-2"))
    again.close()

    fsdp2_plans = ServicePlans(client, epoch_id=epoch_id, rank=rank, report=False)
    results["fsdp2"] = _fsdp2(out, docs, [sorted(p.sample_ids) for p in plans], fsdp2_plans, world)
    fsdp2_plans.close()

    plan_for_step, num_steps = local_planner(samples, cluster=cluster, cost_model=cost_model,
                                             samples_per_step=SAMPLES_PER_STEP, seed=SEED)
    results["local"] = _dcp(out / "local", docs, LocalPlans(plan_for_step, num_steps=num_steps, rank=rank))
    try:
        import trl  # noqa: F401
    except ImportError:
        results["sft"] = None
    else:
        sft_plans = ServicePlans(client, epoch_id=epoch_id, rank=rank)
        sft_resume_plans = ServicePlans(client, epoch_id=epoch_id, rank=rank, report=False)
        results["sft"] = _sft(out, docs, [sorted(p.sample_ids) for p in plans], sft_plans, sft_resume_plans,
                              world)
        sft_plans.close()
        sft_resume_plans.close()
    start_s = time.perf_counter()
    results["ring"] = _ring(out, docs, client, epoch_id=f"{epoch_id}-ring", rank=rank, world=world,
                            samples=samples, cluster=cluster, cost_model=cost_model)
    results["ring"]["time_s"] = time.perf_counter() - start_s
    client.close()
    if rank != 0:
        results["ring"].pop("params")
        results["ring"].pop("plain_params")
        for key in ("plain", "dcp", "resumed", "local"):
            results[key].pop("params")
        results["fsdp2"].pop("params")
        results["fsdp2"].pop("plain_params")
        if results["sft"] is not None:
            results["sft"].pop("params")
            results["sft"].pop("plain_params")
            results["sft"].pop("resumed_params")
    return results


def main() -> None:
    """Run everything, write ``rank{r}.pt`` (an ``error`` entry when a run failed)."""
    import os

    torch.set_num_threads(1)
    url, epoch_id, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ.get("RANK", "0"))
    try:
        results = run(url, epoch_id, out)
    except Exception:
        results = {"error": traceback.format_exc()}
        torch.save(results, out / f"rank{rank}.pt")
        raise
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
