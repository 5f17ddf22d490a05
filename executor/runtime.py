"""The per-rank step interpreter: agree on the plan, feed micro-batches, sync gradients once.

Step semantics (docs/design.md, docs/executor.md): every token's loss is weighted by ``1 / global token count`` (or,
for sample normalisation, ``1 / (sample tokens * global sample count)``), each rank backwards
the weighted sum over its own shard of every micro-batch (gradients accumulate in ``.grad``),
and :meth:`Executor.sync_gradients` sums the gradients over the whole world in one
all-reduce. Inside a group the shards' losses add up to the micro-batch's loss and the
all-to-all's backward routes every contribution to the rank that owns it, so the world sum is
exactly the gradient of the plain large-batch step, whatever the groups, micro-batches and
checkpoint policies (up to rounding).

DDP and FSDP2: pass ``grad_sync=DDPSync(...)`` or ``FSDP2Sync(...)`` (:mod:`executor.grad_sync`):
the library then sums (not averages) the gradients once, in the backward of the rank's last
micro-batch, and :meth:`Executor.sync_gradients` has nothing left to do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from costmodel.specs import Sample
from executor.consistency import check_plan_agreement
from executor.context import SPContext
from executor.grad_sync import AllReduceSync, GradSync
from executor.groups import GroupRegistry
from executor.layout import PackedLayout, SampleShape
from executor.ring_layout import RingGroups, RingLayout
from planner.plan import LossNormalizer, RankPlan

if TYPE_CHECKING:
    from executor.measure import StepTimer
    from executor.step_gc import StepGC

logger = logging.getLogger(__name__)

Item = Mapping[str, object]
"""One loaded sample: ``inputs`` and ``targets`` tensors (first dim = tokens), optional ``id``."""


@dataclass(kw_only=True, frozen=True, slots=True)
class MicroBatchWork:
    """One micro-batch as this rank runs it."""

    index: int
    """Position of the micro-batch in the group's list."""
    ctx: SPContext
    """Layout and process group, to pass to the model."""
    inputs: torch.Tensor
    """This rank's shard of the packed inputs."""
    targets: torch.Tensor
    """This rank's shard of the packed targets."""
    token_weights: torch.Tensor
    """Weight of every local token's loss (global normalisation built in)."""
    recompute_layers: tuple[int, ...]
    """Checkpoint policy per sample."""
    sample_ids: tuple[str, ...]
    """The samples, in order (empty for a padding micro-batch)."""
    is_padding: bool = False
    """A padding micro-batch (loss weight zero) that only makes this rank take part in the
    gradient sync of DDP or FSDP2 (:mod:`executor.grad_sync`)."""

    def loss(self, token_losses: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step loss: ``sum(token_losses * token_weights)``.

        Raises:
            ValueError: when ``token_losses`` does not have one value per local token.
        """
        if token_losses.shape != self.token_weights.shape:
            raise ValueError(f"token_losses has shape {tuple(token_losses.shape)}, expected "
                             f"{tuple(self.token_weights.shape)} (one per local token)")
        return (token_losses * self.token_weights.to(token_losses.dtype)).sum()


def sample_shape(sample: Sample) -> SampleShape:
    """The model-side shape of a planned sample."""
    return SampleShape(tokens=sample.tokens, frames=sample.num_frames)


def token_weights(samples: Sequence[Sample], layout: PackedLayout | RingLayout, normalizer: LossNormalizer,
                  *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Per local token loss weight so that the world's weighted sum is the step's mean loss."""
    parts = []
    for s, sample in enumerate(samples):
        count = layout.pieces[s][layout.index_in_group]
        if normalizer.kind == "tokens":
            weight = 1.0 / normalizer.total
        else:
            weight = 1.0 / (sample.tokens * normalizer.total)
        parts.append(torch.full((count,), weight, dtype=dtype, device=device))
    return torch.cat(parts)


class Executor:
    """Runs planned steps on one rank. Create once, after ``init_process_group``."""

    def __init__(self, *, registry: GroupRegistry, device: torch.device | str = "cpu",
                 weight_dtype: torch.dtype = torch.float64, timer: StepTimer | None = None,
                 grad_sync: GradSync | None = None, step_gc: StepGC | None = None) -> None:
        """Bind the executor to its groups.

        Args:
            registry: The process groups (created at start-up).
            device: Device of inputs and the digest collective (``cuda`` under NCCL).
            weight_dtype: Dtype of the loss weights (fp64 keeps ``1/N`` exact enough).
            timer: Times each micro-batch between its hand-out and the next request
                (``executor.measure``), when measurements are reported.
            grad_sync: How gradients are summed over the world (``executor.grad_sync``):
                ``AllReduceSync()`` (default), ``DDPSync(ddp_model, ...)`` or
                ``FSDP2Sync(sharded_model, ...)``.
            step_gc: Python's garbage collector at step boundaries (``executor.step_gc``):
                :meth:`begin_step` runs it before the step's work, never inside a micro-batch.
        """
        self.registry = registry
        self.rank = registry.rank
        self.world_size = registry.world_size
        self.device = torch.device(device)
        self.weight_dtype = weight_dtype
        self.timer = timer
        self.grad_sync: GradSync = grad_sync if grad_sync is not None else AllReduceSync()
        self.step_gc = step_gc

    def begin_step(self, rank_plan: RankPlan, *, step: int) -> None:
        """Check, on every rank together, that all hold the same plan for ``step``.

        Raises:
            PlanMismatchError: on every rank when plans differ.
            ValueError: on every rank, when the agreed plan uses a group size that was not registered.
        """
        check_plan_agreement(rank_plan, step=step, rank=self.rank, world_size=self.world_size,
                             device=self.device)
        # every rank, every group: raise together
        self.registry.check_layout(rank_plan.group_sizes, rank_plan.ring_degrees)
        self.registry.group_for(rank_plan.group)
        if self.step_gc is not None:
            self.step_gc.at_step_boundary()
        if self.timer is not None:
            self.timer.begin_step(rank_plan, step=step)

    def micro_batches(self, rank_plan: RankPlan, *,
                      loaded: Iterable[Sequence[Item]] | None = None,
                      load_sample: Callable[[Sample], Item] | None = None) -> Iterator[MicroBatchWork]:
        """Yield this rank's micro-batches, sharded and weighted, in plan order.

        Give either ``loaded`` (one list of items per micro-batch, e.g. a DataLoader over
        :class:`executor.data.PlanBatchSampler`) or ``load_sample`` (loads one planned sample).

        Raises:
            ValueError: when the loaded items do not match the plan (count, id or token count).
        """
        if (loaded is None) == (load_sample is None):
            raise ValueError("give exactly one of loaded= or load_sample=")
        group = rank_plan.group
        process_group = self.registry.group_for(group)
        batches = iter(loaded) if loaded is not None else None
        sync_index = self.grad_sync.sync_index([[ps.recompute_layers for ps in mb.samples]
                                                for mb in group.micro_batches])
        self.grad_sync.begin_step()
        for index, micro in enumerate(group.micro_batches):
            samples = [ps.sample for ps in micro.samples]
            if batches is not None:
                try:
                    items = list(next(batches))
                except StopIteration:
                    raise ValueError(f"step {rank_plan.step}: the loader ended before micro-batch "
                                     f"{index} of {len(group.micro_batches)}") from None
            else:
                assert load_sample is not None
                items = [load_sample(s) for s in samples]
            work = self._work(rank_plan, index, samples, items, process_group,
                              tuple(ps.recompute_layers for ps in micro.samples))
            if self.timer is not None:
                self.timer.start()
            with self.grad_sync.micro_batch(sync=index == sync_index):
                yield work
            if self.timer is not None:
                self.timer.stop()
        if sync_index is None and self.grad_sync.in_backward:
            with self.grad_sync.micro_batch(sync=True):
                yield self._padding_work(len(group.micro_batches))

    def _padding_work(self, index: int) -> MicroBatchWork:
        """A group-of-one micro-batch of the sync mode's idle item, at loss weight zero."""
        item = self.grad_sync.idle_item
        assert item is not None
        inputs, targets = item["inputs"], item["targets"]
        assert isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)
        frames = item.get("frames", 1)
        layout = PackedLayout(samples=(SampleShape(tokens=int(inputs.shape[0]), frames=int(frames)),),  # type: ignore[call-overload]
                              group_size=1, index_in_group=0)
        return MicroBatchWork(index=index, ctx=SPContext(layout=layout, group=None),
                              inputs=inputs.to(self.device), targets=targets.to(self.device),
                              token_weights=torch.zeros(int(inputs.shape[0]), dtype=self.weight_dtype,
                                                        device=self.device),
                              recompute_layers=(0,), sample_ids=(), is_padding=True)

    def _work(self, rank_plan: RankPlan, index: int, samples: list[Sample], items: list[Item],
              process_group: dist.ProcessGroup | RingGroups | None, policies: tuple[int, ...]) -> MicroBatchWork:
        if len(items) != len(samples):
            raise ValueError(f"step {rank_plan.step} micro-batch {index}: {len(items)} items loaded "
                             f"for {len(samples)} planned samples")
        group = rank_plan.group
        shapes = tuple(sample_shape(s) for s in samples)
        layout: PackedLayout | RingLayout
        if group.ring_degree > 1:  # Ulysses x ring (executor.ring)
            try:
                layout = RingLayout(samples=shapes, ulysses_degree=group.ulysses_degree,
                                    ring_degree=group.ring_degree, index_in_group=rank_plan.index_in_group)
            except ValueError as err:
                raise ValueError(f"step {rank_plan.step}, group of ranks {group.first_rank}..{group.ranks[-1]}, "
                                 f"micro-batch {index}: {err}") from None
        else:
            layout = PackedLayout(samples=shapes, group_size=group.size, index_in_group=rank_plan.index_in_group)
        inputs: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        for s, (sample, item) in enumerate(zip(samples, items, strict=True)):
            item_id = item.get("id")
            if item_id is not None and item_id != sample.id:
                raise ValueError(f"step {rank_plan.step} micro-batch {index}: loaded sample "
                                 f"{item_id!r} where the plan has {sample.id!r}")
            for key, bucket in (("inputs", inputs), ("targets", targets)):
                value = item.get(key)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"sample {sample.id!r}: item[{key!r}] must be a tensor")
                bucket.append(layout.shard(value, s))
        if isinstance(layout, RingLayout):
            assert isinstance(process_group, RingGroups)
            ctx = SPContext.for_ring(layout, process_group)
        else:
            assert not isinstance(process_group, RingGroups)
            ctx = SPContext(layout=layout, group=process_group)
        return MicroBatchWork(
            index=index,
            ctx=ctx,
            inputs=torch.cat(inputs).to(self.device),
            targets=torch.cat(targets).to(self.device),
            token_weights=token_weights(samples, layout, rank_plan.loss_normalizer,
                                        dtype=self.weight_dtype, device=self.device),
            recompute_layers=policies,
            sample_ids=tuple(s.id for s in samples),
        )

    def sync_gradients(self, module: torch.nn.Module) -> None:
        """Finish the step's gradient sum over the world (the chosen ``grad_sync`` mode).

        Default: one all-reduce SUM per dtype; parameters without a gradient (a rank with no
        micro-batch) contribute zeros, so every replica ends with the same ``.grad``. Under
        DDP or FSDP2 the last backward already summed: nothing is left to do.
        """
        self.grad_sync.finish(module, world_size=self.world_size)
