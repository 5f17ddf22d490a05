"""DCP under the Hugging Face ``transformers.Trainer`` (and TRL's ``SFTTrainer``): change the class,
keep the rest of the training script.

:class:`DCPTrainer` is a ``Trainer`` whose optimizer step is one planned DCP step; the ``Trainer``
keeps its optimizer, scheduler, gradient clipping, logging, checkpoint saving and resume. What
changes, each at the ``Trainer``'s own extension point:

- ``__init__``: the model's attention becomes Ulysses (:mod:`executor.integrations.hf_transformers`,
  ``model.set_attn_implementation``; Ulysses x ring in the groups whose plan layout has a ring) with
  per-sample checkpoint policies on its decoder layers, and the sequence-parallel process groups are
  created once (:class:`executor.groups.GroupRegistry`; from the epoch's declared layouts when the
  plan source has them, ``ServicePlans.layouts``).
- ``get_train_dataloader``: item ``k`` is this rank's step ``k`` of the epoch, its plan and the
  whole samples of its micro-batches (:class:`~executor.integrations.hf_trainer_data.PlannedSteps`).
  ``gradient_accumulation_steps`` must be 1: the plan's micro-batches are the accumulation.
- ``evaluation_loop`` (``evaluate``, ``predict``, ``eval_strategy='steps'``): the ``Trainer``'s own
  loop, each rank on its shard of the eval set, on the model's plain attention; the metrics are the
  plain ``Trainer``'s (:mod:`executor.integrations.hf_trainer_eval` says why this way).
- ``training_step``: the digest check, then each micro-batch's forward and backward through the
  :class:`executor.runtime.Executor`, then the step's gradient sum over the world (the ``Trainer``'s
  DDP with a SUM hook, FSDP2 with a divide factor of 1, or one all-reduce without either).

Loss (docs/design.md, 'Step semantics'; ``executor/runtime.py``): every trained target's cross-entropy is
weighted by ``1 / (trained targets of the whole step)`` and the gradients are summed over the
world, so a step equals the ``Trainer``'s own data-parallel step over the same global batch
(which normalises by ``num_items_in_batch`` gathered over the devices). Labels of ``-100`` are
not trained on: their global count is one scalar all-reduce per step. A plan normalised by
samples weights each sample's tokens by ``1 / (its tokens * samples in the step)``.

FSDP2: a model sharded at load time by ``transformers`` (``from_pretrained(..., distributed_config=
DistributedConfig(fsdp_size=world_size))``), which the ``Trainer`` leaves unwrapped, runs under
:class:`~executor.grad_sync.FSDP2Sync` (one all-gather and one SUM reduce-scatter per step); tested on
gloo CPU against the plain ``Trainer`` on the same sharded model. Two other FSDP2 routes do not run on
CPU with gloo (transformers 5.24.0, accelerate 1.16.0): ``TrainingArguments(fsdp=..., fsdp_config=
{"version": 2})`` is ignored without a word, because accelerate's ``AcceleratorState`` keeps the FSDP
plugin only for GPU-like distributed types (``MULTI_GPU``, ``MULTI_XPU``, ...), not ``MULTI_CPU``, and
the model is wrapped in DDP instead; a model passed through ``fully_shard`` by hand is wrapped in DDP by
``Accelerator.prepare_model``, which fails in DDP's parameter broadcast with ``RuntimeError:
aten.cat.default got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before
calling distributed operators!``. On GPUs the first route's ``fully_shard`` model would get FSDP2Sync
too (not run: no GPU). Resume is not tested under FSDP2 (the ``Trainer`` refuses optimizer checkpoints
of a model sharded at load: ``save_only_model=True`` or ``save_strategy='no'``).

Measured micro-batch times and peaks are posted to the service (the recalibration route) when
the plans come from :class:`~executor.integrations.hf_trainer_data.ServicePlans`.

Usage (see ``examples/train_hf_trainer.py``)::

    plans = ServicePlans(PlannerClient(url), epoch_id=epoch_id, rank=args.process_index)
    trainer = DCPTrainer(model=model, args=args, train_dataset=dataset, plans=plans)
    trainer.train()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer

from costmodel.specs import LOSS_CHUNK_TOKENS_DEFAULT
from executor.chunked_loss import check_chunk_tokens
from executor.grad_sync import AllReduceSync, DDPSync, FSDP2Sync, GradSync
from executor.groups import GroupRegistry
from executor.integrations import hf_transformers as hf
from executor.integrations.hf_trainer_data import (
    BATCH_KEY,
    IGNORE_INDEX,
    PlannedSteps,
    PlanSource,
    StepBatch,
    causal_lm_item,
    single_item,
)
from executor.integrations.hf_trainer_eval import (
    CausalLMPadding,
    eval_attention_of,
    pad_token_id_of,
    plain_attention,
)
from executor.measure import StepTimer
from executor.runtime import Executor, MicroBatchWork

logger = logging.getLogger(__name__)


def allowed_group_sizes(config: Any, *, world_size: int) -> list[int]:
    """Group sizes up to ``world_size`` that Ulysses allows for the model's heads
    (:func:`executor.integrations.hf_transformers.check_heads`)."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return [d for d in range(1, world_size + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]


def _check_args(args: Any) -> None:
    """Trainer arguments DCP needs; fills the DDP options it needs when unset.

    Raises:
        ValueError: naming an argument DCP cannot run with.
    """
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: under DCP one DataLoader item is "
            "a whole optimizer step whose plan already splits the global batch into micro-batches and "
            "accumulates their gradients (the plan's micro-batches are the accumulation); the Trainer's "
            f"accumulation would merge {args.gradient_accumulation_steps} planned steps into one optimizer "
            "step, each normalised alone. Set gradient_accumulation_steps=1 and size the global batch with "
            "the epoch's samples_per_step")
    if args.ddp_broadcast_buffers:
        raise ValueError("ddp_broadcast_buffers=True broadcasts buffers at every forward, and ranks run "
                         "different numbers of forwards: leave it unset or False")
    args.ddp_broadcast_buffers = False
    if args.ddp_find_unused_parameters is None:
        args.ddp_find_unused_parameters = False


class DCPTrainerMixin:
    """The DCP parts of :class:`DCPTrainer`, for any ``transformers.Trainer`` subclass."""

    _dcp_default_eval_collator = False
    """Give evaluation :class:`CausalLMPadding` when the script passes no ``data_collator``."""

    def __init__(self, model: Any = None, args: Any = None, *posargs: Any, plans: PlanSource,
                 group_sizes: Sequence[int] | None = None, id_column: str | None = None,
                 to_item: Callable[..., Mapping[str, object]] | None = None,
                 weight_dtype: torch.dtype = torch.float64, eval_attention: str | None = None,
                 loss_chunk_tokens: int = LOSS_CHUNK_TOKENS_DEFAULT, **kwargs: Any) -> None:
        """Build the ``Trainer``, then switch the model to DCP and create the process groups.

        Args:
            model: The model (a ``transformers`` causal LM with ``AttentionInterface`` attention).
            args: The ``TrainingArguments`` (``gradient_accumulation_steps=1``).
            *posargs: The ``Trainer``'s further positional arguments.
            plans: This rank's plans (``ServicePlans`` or ``LocalPlans``).
            group_sizes: Sizes the plans may use (default: every size the heads allow), when the plan
                source declares no layouts; a source with ``layouts`` (``ServicePlans``: the epoch's
                ``(size, ulysses_degree, ring_degree)``) gets exactly those groups, rings included.
            id_column: Column of the sample ids the epoch was planned with (default: row index).
            to_item: ``(row, sample_id=...) -> {"inputs", "targets"}`` (default: ``causal_lm_item``).
            weight_dtype: Dtype of the loss weights.
            eval_attention: Attention implementation evaluation runs on (default: the model's own
                before the switch to DCP, else ``sdpa``).
            loss_chunk_tokens: Tokens per chunk of the training loss (``hf_transformers.lm_token_losses``;
                the planner's ``ModelSpec.loss_chunk_tokens``), 0 for whole logits.
            **kwargs: The ``Trainer``'s other keyword arguments (``train_dataset``, ``eval_dataset``,
                ``data_collator`` for evaluation: default :class:`CausalLMPadding` in ``DCPTrainer``).

        Raises:
            ValueError: for arguments DCP cannot run with, or heads the group sizes do not fit.
        """
        if args is not None:
            _check_args(args)
            if getattr(args, "packing", False):  # TRL's SFTConfig: the plans pack the micro-batches
                logger.info("DCP packs each micro-batch from the plan: the dataset is prepared unpacked")
                args.packing = False
        if self._dcp_default_eval_collator and kwargs.get("data_collator") is None and model is not None:
            kwargs["data_collator"] = CausalLMPadding(pad_token_id=pad_token_id_of(model))
        self.dcp_eval_attention = eval_attention_of(model, requested=eval_attention)
        super().__init__(model, args, *posargs, **kwargs)  # type: ignore[call-arg]
        trainer: Any = self
        _check_args(trainer.args)
        self.dcp_plans = plans
        self.dcp_to_item = to_item or causal_lm_item
        self.dcp_weight_dtype = weight_dtype
        self.dcp_loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        self.dcp_rank, self.dcp_world_size = int(trainer.args.process_index), int(trainer.args.world_size)
        core = trainer.model
        layouts = getattr(plans, "layouts", None)
        if layouts:  # the epoch's declared layouts (Ulysses x ring included)
            self.dcp_registry = GroupRegistry.from_layouts(world_size=self.dcp_world_size, rank=self.dcp_rank,
                                                           layouts=layouts)
        else:
            sizes = list(group_sizes) if group_sizes is not None else allowed_group_sizes(
                core.config, world_size=self.dcp_world_size)
            self.dcp_registry = GroupRegistry(world_size=self.dcp_world_size, rank=self.dcp_rank, group_sizes=sizes)
        core.set_attn_implementation(hf.register())
        hf.prepare(core, group_sizes=self.dcp_registry.ulysses_degrees)
        dataset = trainer.train_dataset
        self.dcp_index_of = {(str(dataset[i][id_column]) if id_column else str(i)): i for i in range(len(dataset))}
        self._dcp_executor: Executor | None = None
        self._dcp_model: nn.Module | None = None
        self._dcp_timer: StepTimer | None = None
        self.dcp_history: list[dict[str, Any]] = []
        """Per step run: ``step``, ``plan_digest``, ``loss_share`` (this rank's share of the step loss)."""

    # ------------------------------------------------------------ Trainer hooks
    def get_train_dataloader(self) -> DataLoader[dict[str, object]]:
        """One item per planned step of this rank (never sharded again by ``accelerate``)."""
        trainer: Any = self
        steps = PlannedSteps(self.dcp_plans, trainer.train_dataset, index_of=self.dcp_index_of,
                             to_item=self.dcp_to_item)
        if trainer.args.dataloader_num_workers:
            logger.info("rank %d: DCP steps load in the main process (dataloader_num_workers=%d ignored)",
                        self.dcp_rank, trainer.args.dataloader_num_workers)
        return DataLoader(steps, batch_size=1, shuffle=False, collate_fn=single_item, num_workers=0)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, with measurements posted to the service while it runs."""
        opener = getattr(self.dcp_plans, "open_reporting", None)
        sink = opener() if opener is not None else None
        trainer: Any = self
        self._dcp_timer = StepTimer(rank=self.dcp_rank, sink=sink, device=trainer.args.device) if sink else None
        if self._dcp_executor is not None:
            self._dcp_executor.timer = self._dcp_timer
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            if self._dcp_timer is not None:
                self._dcp_timer.flush()
            closer = getattr(self.dcp_plans, "close_reporting", None)
            if closer is not None:
                closer()

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.evaluation_loop`` on the model's plain attention (``evaluate``, ``predict`` and
        evaluation during ``train``): each rank its shard of the eval set, metrics gathered as the
        plain ``Trainer`` gathers them (:mod:`executor.integrations.hf_trainer_eval`)."""
        trainer: Any = self
        with plain_attention(trainer.model, implementation=self.dcp_eval_attention):
            return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]

    def training_step(self, model: nn.Module, inputs: Mapping[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Run this rank's whole planned step (forward and backward of each micro-batch, then the
        gradient sum over the world); returns ``world_size x`` this rank's share of the step loss,
        so that the ``Trainer``'s mean over processes logs the step loss."""
        trainer: Any = self
        batch = inputs.get(BATCH_KEY)
        if not isinstance(batch, StepBatch):
            raise ValueError(f"DCPTrainer.training_step expects items of its own DataLoader ({BATCH_KEY!r})")
        model.train()
        if hasattr(trainer.optimizer, "train") and callable(trainer.optimizer.train):
            trainer.optimizer.train()
        executor = self._executor_for(model)
        rank_plan = batch.rank_plan
        executor.begin_step(rank_plan, step=batch.step)
        num_targets = self._num_trained_targets(batch)
        total = torch.zeros((), dtype=torch.float64, device=executor.device)
        for work in executor.micro_batches(rank_plan, loaded=iter(batch.micro_batches)):
            with trainer.compute_loss_context_manager():
                loss = self.micro_batch_loss(model, work, num_targets=num_targets)
            trainer.accelerator.backward(loss)
            total += loss.detach().to(torch.float64)
        executor.sync_gradients(model)
        self.dcp_history.append({"step": batch.step, "plan_digest": rank_plan.plan_digest,
                                 "loss_share": float(total)})
        return (total * self.dcp_world_size).to(trainer.args.device)

    # ------------------------------------------------------------ DCP parts
    def micro_batch_loss(self, model: nn.Module, work: MicroBatchWork, *, num_targets: int) -> torch.Tensor:
        """This rank's share of the step loss for one micro-batch (override for another loss)."""
        losses = hf.lm_token_losses(model, work, loss_chunk_tokens=self.dcp_loss_chunk_tokens)
        if work.is_padding or num_targets <= 0:
            return work.loss(losses)
        weights = (work.targets != IGNORE_INDEX).to(losses.dtype) / num_targets
        return (losses * weights).sum()

    def _num_trained_targets(self, batch: StepBatch) -> int:
        """Targets trained on in the whole step (0 under sample normalisation): each group's first
        rank counts its samples, one all-reduce sums them.

        Raises:
            ValueError: when the step has no trained target, or more than the plan's tokens.
        """
        normalizer = batch.rank_plan.loss_normalizer
        if normalizer.kind != "tokens":
            return 0
        local = batch.num_trained_targets() if batch.rank_plan.index_in_group == 0 else 0
        count = torch.tensor([local], dtype=torch.int64, device=self._dcp_executor_device())
        if self.dcp_world_size > 1:
            dist.all_reduce(count)
        total = int(count.item())
        if total <= 0 or total > normalizer.total:
            raise ValueError(f"step {batch.step}: {total} trained targets for the plan's {normalizer.total} "
                             "tokens (does the dataset match the planned manifest?)")
        return total

    def _dcp_executor_device(self) -> torch.device:
        assert self._dcp_executor is not None
        return self._dcp_executor.device

    def _executor_for(self, model: nn.Module) -> Executor:
        """The executor of the model the ``Trainer`` runs (its DDP or FSDP2 wrapper decides the sync)."""
        if self._dcp_executor is not None and model is self._dcp_model:
            return self._dcp_executor
        from torch.distributed.fsdp import FSDPModule

        trainer: Any = self
        one_token = {"inputs": torch.zeros(1, dtype=torch.long), "targets": torch.zeros(1, dtype=torch.long)}
        sync: GradSync
        if isinstance(model, nn.parallel.DistributedDataParallel):
            sync = DDPSync(model, idle_item=one_token)
        elif isinstance(model, FSDPModule):
            sync = FSDP2Sync(model, idle_item=one_token)
        else:
            sync = AllReduceSync()
        self._dcp_executor = Executor(registry=self.dcp_registry, device=trainer.args.device,
                                      weight_dtype=self.dcp_weight_dtype, timer=self._dcp_timer,
                                      grad_sync=sync)
        self._dcp_model = model
        logger.info("rank %d: DCP steps with %s gradient sync", self.dcp_rank, type(sync).__name__)
        return self._dcp_executor


class DCPTrainer(DCPTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose optimizer steps are DCP plans (module docstring)."""

    _dcp_default_eval_collator = True


def dcp_sft_trainer_class() -> type:
    """``DCPSFTTrainer``: TRL's ``SFTTrainer`` under DCP plans (needs the ``trl`` extra)."""
    from trl import SFTTrainer

    return type("DCPSFTTrainer", (DCPTrainerMixin, SFTTrainer), {
        "__doc__": "TRL's SFTTrainer whose optimizer steps are DCP plans (DCP packs the micro-batches)."})
