"""How a planned step's gradients are summed over the world: the user's choice of training stack.

The plan's loss weights already carry the global normalisation (``1 / global tokens``), so the
step's gradient is the plain SUM of every rank's accumulated gradient; each mode below makes its
library sum (not average) and sync exactly once per step, on every rank, whatever the plan:

- :class:`AllReduceSync` (default): gradients kept whole on every rank, accumulated over the
  micro-batches, one all-reduce per dtype in :meth:`Executor.sync_gradients`.
- :class:`DDPSync`: ``torch.nn.parallel.DistributedDataParallel``. Every micro-batch but the
  rank's last runs under ``no_sync()``; the last one's backward runs DDP's bucketed all-reduce
  (a SUM comm hook replaces DDP's average).
- :class:`FSDP2Sync`: ``torch.distributed.fsdp.fully_shard`` (parameters, gradients and optimizer
  states sharded over the world). Parameters are all-gathered once at the step's first
  micro-batch and kept until its last backward (ranks run different numbers of forwards, so no
  per-forward all-gather may be left), gradients are reduce-scattered with SUM (divide factor
  1) by the last backward.

Ranks differ in micro-batch counts (a rank may have none) and a layer whose samples have
different checkpoint policies runs twice. For DDP and FSDP2 every rank must still issue the
same collectives, so the executor adds a *padding* micro-batch (the mode's ``idle_item``, loss
weight zero, a group of one) where a rank has no micro-batch, and for FSDP2 also where the last
micro-batch would run a layer twice (its reduce-scatter would then run twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Item = Mapping[str, object]


class AllReduceSync:
    """Gradients kept whole; one world all-reduce per dtype after the step (the default)."""

    in_backward = False
    """Whether the sync happens inside the last backward (then a rank must run one)."""
    idle_item: Item | None = None

    def begin_step(self) -> None:
        """Called before the step's first micro-batch is handed out."""

    def sync_index(self, policies: Sequence[Sequence[int]]) -> int | None:
        """Index of the micro-batch whose backward syncs (``None``: add a padding one)."""
        return len(policies) - 1 if policies else None

    @contextlib.contextmanager
    def micro_batch(self, *, sync: bool) -> Iterator[None]:
        """Context the user's forward and backward of one micro-batch run in."""
        yield

    def finish(self, module: nn.Module, *, world_size: int) -> None:
        """Sum ``module``'s gradients over the world (ranks without gradients add zeros)."""
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):
            group = by_dtype[dtype]
            flat = torch.cat([p.grad.reshape(-1) for p in group if p.grad is not None])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in group:
                assert p.grad is not None
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n


def _check_idle_item(idle_item: Item) -> None:
    for key in ("inputs", "targets"):
        value = idle_item.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] == 0:
            raise ValueError(f"idle_item[{key!r}] must be a tensor with at least one token (first dim)")


def _sum_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: SUM the bucket (DDP's default divides by the world size).

    ``(state: ProcessGroup, bucket: dist.GradBucket) -> Future[Tensor]``; unannotated because DDP
    checks the annotations as objects and this module's are strings.
    """
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, group=state, async_op=True)  # type: ignore[arg-type]
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


class DDPSync:
    """``DistributedDataParallel``: no sync until the rank's last micro-batch, then a SUM."""

    in_backward = True

    def __init__(self, model: nn.Module, *, idle_item: Item) -> None:
        """Bind to the user's DDP module.

        Args:
            model: The ``DistributedDataParallel`` module the loop runs.
            idle_item: A tiny real item (``inputs``/``targets`` of one token or more) that a rank
                without micro-batches runs at loss weight zero, to take part in the all-reduce.

        Raises:
            ValueError: when ``model`` is not DDP, or DDP would broadcast buffers at every forward
                (``forward_sync_buffers``: a collective that ranks with different micro-batch
                counts cannot match).
        """
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError(f"DDPSync needs a DistributedDataParallel module, got {type(model).__name__}")
        if model.forward_sync_buffers and any(True for _ in model.module.buffers()):
            raise ValueError("DistributedDataParallel(forward_sync_buffers=True) broadcasts buffers at every "
                             "forward, and ranks run different numbers of forwards: pass "
                             "forward_sync_buffers=False")
        _check_idle_item(idle_item)
        model.register_comm_hook(state=model.process_group, hook=_sum_allreduce_hook)
        self.model = model
        self.idle_item = idle_item

    def begin_step(self) -> None:
        """Nothing to do before a step."""

    def sync_index(self, policies: Sequence[Sequence[int]]) -> int | None:
        """The last micro-batch syncs (a rank without one runs a padding micro-batch)."""
        return len(policies) - 1 if policies else None

    def micro_batch(self, *, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """``no_sync()`` unless this micro-batch's backward is the one that all-reduces."""
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def finish(self, module: nn.Module, *, world_size: int) -> None:
        """Nothing left: the last backward summed the gradients."""


class FSDP2Sync:
    """FSDP2 (``fully_shard``): one all-gather per step, one SUM reduce-scatter per step."""

    in_backward = True

    def __init__(self, model: nn.Module, *, idle_item: Item) -> None:
        """Bind to the user's ``fully_shard``-ed model (the root and any sharded sub-modules).

        Args:
            model: The root module after ``fully_shard``.
            idle_item: As for :class:`DDPSync`: the padding micro-batch's inputs and targets.

        Raises:
            ValueError: when ``model`` was not passed to ``fully_shard``.
        """
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            raise ValueError(f"FSDP2Sync needs the root module after fully_shard, got {type(model).__name__}")
        _check_idle_item(idle_item)
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in self.modules:
            m.set_gradient_divide_factor(1.0)  # the plan's weights normalise: reduce with SUM
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (fp32 would use PREMUL_SUM: not on gloo)
            m.set_reshard_after_forward(False, recurse=False)
        self.idle_item = idle_item

    def begin_step(self) -> None:
        """All-gather every sharded module's parameters once, in module order on every rank."""
        for m in self.modules:
            m.unshard()

    def sync_index(self, policies: Sequence[Sequence[int]]) -> int | None:
        """The last micro-batch, unless it runs a layer twice (mixed policies) or there is none."""
        if not policies or len(set(policies[-1])) > 1:
            return None
        return len(policies) - 1

    @contextlib.contextmanager
    def micro_batch(self, *, sync: bool) -> Iterator[None]:
        """Reduce-scatter (and reshard) only in the syncing micro-batch's backward."""
        for m in self.modules:
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_reshard_after_backward(sync, recurse=False)
        yield

    def finish(self, module: nn.Module, *, world_size: int) -> None:
        """Nothing left: the last backward reduce-scattered the gradients."""


GradSync = AllReduceSync | DDPSync | FSDP2Sync
"""The gradient-sync modes the executor runs."""
