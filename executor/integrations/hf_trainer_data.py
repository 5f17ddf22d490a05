"""Plans and data of the Hugging Face ``Trainer`` integration: one DataLoader item per planned step.

The ``Trainer`` counts an optimizer step per ``gradient_accumulation_steps`` items of its train
DataLoader; under DCP one item is a whole step of this rank: its plan and the loaded samples of
each of its micro-batches (:class:`PlannedSteps`). Item ``k`` is step ``k`` of the epoch, so
the ``Trainer``'s resume (which skips the first items of the DataLoader) fetches no plan and
loads no sample of the steps it skips, and the steps it runs are the same steps.

Plans come from a :class:`PlanSource`: :class:`ServicePlans` (the planner service, prefetched,
measurements posted back) or :class:`LocalPlans` (a ``step -> Plan`` function of the user's,
e.g. the planner library called in the training process; this package never imports the solver).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

from costmodel.specs import Sample
from executor.client import PlannerClient, PlanPrefetcher
from executor.measure import MeasurementReporter, ReporterConfig, StepMeasurement
from executor.runtime import Item
from planner.plan import Plan, RankPlan

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label of a token that is not trained on (``transformers``' convention)."""
BATCH_KEY = "dcp_step"
"""Key of the :class:`StepBatch` in a DataLoader item of :class:`PlannedSteps`."""


def causal_lm_item(row: Mapping[str, Any], *, sample_id: str) -> dict[str, object]:
    """A tokenized row as the executor's item: ``inputs = input_ids[:-1]``, ``targets =
    labels[1:]`` (``labels`` default to ``input_ids``; ``-100`` marks a token not trained on).

    Raises:
        ValueError: naming the sample when it has fewer than 2 tokens or labels of another length.
    """
    ids = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
    labels = row.get("labels")
    targets = ids if labels is None else torch.as_tensor(labels, dtype=torch.long).reshape(-1)
    if ids.numel() < 2:
        raise ValueError(f"sample {sample_id!r} has {ids.numel()} token(s); a causal LM sample needs at least 2")
    if targets.shape != ids.shape:
        raise ValueError(f"sample {sample_id!r}: {targets.numel()} labels for {ids.numel()} input_ids")
    return {"id": sample_id, "inputs": ids[:-1], "targets": targets[1:]}


def manifest(dataset: Any, *, id_column: str | None = None) -> list[Sample]:
    """The planner's view of a tokenized causal-LM dataset: one sample per row, ``tokens =
    len(input_ids) - 1`` (the predicted tokens), id = the row's ``id_column`` or its index.

    Raises:
        ValueError: naming a row with fewer than 2 tokens.
    """
    samples = []
    for index in range(len(dataset)):
        row = dataset[index]
        sample_id = str(row[id_column]) if id_column else str(index)
        tokens = len(row["input_ids"]) - 1
        if tokens < 1:
            raise ValueError(f"row {index} (sample {sample_id!r}) has {tokens + 1} token(s); at least 2 needed")
        samples.append(Sample(id=sample_id, tokens=tokens))
    return samples


class PlanSource(Protocol):
    """Where a rank's plans come from. A source may also have ``layouts``: the ``(size,
    ulysses_degree, ring_degree)`` triples its plans may use (``ServicePlans``: the epoch's declared
    layouts), from which ``DCPTrainer`` builds its process groups (``GroupRegistry.from_layouts``)."""

    num_steps: int
    """Steps of the epoch."""

    def get(self, step: int) -> RankPlan:
        """This rank's plan of ``step``."""
        ...


class ServicePlans:
    """Plans of a service epoch for one rank (prefetched), and the reporter of its measurements."""

    def __init__(self, client: PlannerClient, *, epoch_id: str, rank: int, num_steps: int | None = None,
                 depth: int = 4, report: bool = True, reporter: ReporterConfig | None = None,
                 fallback: Callable[[int], Plan] | None = None) -> None:
        """Bind to an epoch job of the service.

        Args:
            client: The service client.
            epoch_id: The epoch job (started by ``POST /v1/epochs`` or ``dcp epoch``).
            rank: This rank.
            num_steps: Steps of the epoch (default: the job's ``steps_total``).
            depth: Steps fetched ahead.
            report: Post measured micro-batch times and peaks (the recalibration route).
            reporter: Batching of the posts.
            fallback: Local ``step -> Plan`` used when the service stays unreachable.
        """
        self.client, self.epoch_id, self.rank = client, epoch_id, rank
        self.num_steps = int(client.epoch_status(epoch_id)["steps_total"]) if num_steps is None else num_steps
        if self.num_steps <= 0:
            raise ValueError(f"epoch {epoch_id!r} has num_steps={self.num_steps}")
        self.prefetcher = PlanPrefetcher(client, epoch_id=epoch_id, rank=rank, depth=depth,
                                         num_steps=self.num_steps, fallback=fallback)
        self.layouts = client.epoch_layouts(epoch_id)
        """The epoch's declared layouts ``(size, ulysses_degree, ring_degree)`` (``None`` for an epoch
        stored before epochs declared them: Ulysses groups of the sizes the heads allow)."""
        self.report = report
        self.reporter_config = reporter or ReporterConfig(batch_steps=4, flush_interval_s=1.0)
        self._reporter: MeasurementReporter | None = None
        self.fetched: dict[int, str] = {}
        """Digest of every step this rank fetched."""

    def get(self, step: int) -> RankPlan:
        """This rank's plan of ``step`` (the service freezes a fetched step: a refetch after a
        resume gets the same plan)."""
        plan = self.prefetcher.get(step)
        self.fetched[step] = plan.plan_digest
        return plan

    def open_reporting(self) -> Callable[[StepMeasurement], None] | None:
        """Start a reporter; returns its sink (``None`` when reporting is off)."""
        if not self.report:
            return None
        self.close_reporting()
        self._reporter = MeasurementReporter(self.client, epoch_id=self.epoch_id, rank=self.rank,
                                             config=self.reporter_config)
        return self._reporter.submit

    def close_reporting(self, *, timeout_s: float = 30.0) -> None:
        """Post what is queued and stop the reporter."""
        if self._reporter is not None:
            self._reporter.close(timeout_s=timeout_s)
            self._reporter = None

    def close(self) -> None:
        """Stop prefetching and reporting (the client stays open: it is the caller's)."""
        self.close_reporting()
        self.prefetcher.close()


class LocalPlans:
    """Plans made in the training process by a function of the user's (every rank must get the
    same plan for a step: the executor checks the digests and fails loudly otherwise)."""

    def __init__(self, plan_for_step: Callable[[int], Plan], *, num_steps: int, rank: int,
                 layouts: Sequence[tuple[int, int, int]] | None = None) -> None:
        """Args:
            plan_for_step: ``step -> Plan`` (deterministic: the same on every rank).
            num_steps: Steps of the epoch.
            rank: This rank.
            layouts: ``(size, ulysses_degree, ring_degree)`` the plans may use (e.g.
                ``planner.layouts.config_layouts``); ``None``: Ulysses groups only.
        """
        if num_steps <= 0:
            raise ValueError(f"num_steps must be positive, got {num_steps}")
        self.plan_for_step, self.num_steps, self.rank = plan_for_step, num_steps, rank
        self.layouts = None if layouts is None else [tuple(int(x) for x in t) for t in layouts]
        self.fetched: dict[int, str] = {}
        """Digest of every step this rank planned."""

    def get(self, step: int) -> RankPlan:
        """This rank's view of the local plan of ``step``.

        Raises:
            ValueError: when the plan is for another step or another world.
        """
        plan = self.plan_for_step(step)
        if plan.step is not None and plan.step != step:
            raise ValueError(f"plan_for_step({step}) returned the plan of step {plan.step}")
        if self.rank >= plan.num_ranks:
            raise ValueError(f"rank {self.rank} is outside the plan's world of {plan.num_ranks}")
        view = plan.rank_view(self.rank)
        self.fetched[step] = view.plan_digest
        return view


@dataclass(kw_only=True, frozen=True, slots=True)
class StepBatch:
    """One step of this rank: its plan and the items of each of its micro-batches."""

    step: int
    """Step index in the epoch."""
    rank_plan: RankPlan
    """This rank's plan of the step."""
    micro_batches: tuple[tuple[Item, ...], ...]
    """The loaded whole samples of each micro-batch, in plan order."""

    def num_trained_targets(self) -> int:
        """Targets that are not ``-100`` in this rank's whole samples."""
        count = 0
        for micro in self.micro_batches:
            for item in micro:
                targets = item["targets"]
                assert isinstance(targets, torch.Tensor)
                count += int((targets != IGNORE_INDEX).sum())
        return count


class PlannedSteps(Dataset[dict[str, object]]):
    """Map-style dataset over the steps of an epoch: item ``k`` is this rank's step ``k``."""

    def __init__(self, plans: PlanSource, dataset: Any, *, index_of: Mapping[str, int],
                 to_item: Callable[..., Mapping[str, object]] = causal_lm_item) -> None:
        """Args:
            plans: This rank's plan source.
            dataset: The user's map-style dataset (e.g. a tokenized ``datasets.Dataset``).
            index_of: Dataset index of every sample id.
            to_item: ``(row, sample_id=...) -> item`` with ``inputs`` and ``targets``.
        """
        self.plans, self.dataset, self.index_of, self.to_item = plans, dataset, index_of, to_item

    def __len__(self) -> int:
        return self.plans.num_steps

    def __getitem__(self, step: int) -> dict[str, object]:
        """``{"dcp_step": StepBatch, "input_ids": ...}``; ``input_ids`` holds the step's tokens on
        the first rank of each group only (empty elsewhere), so that the ``Trainer``'s token and
        FLOP counts, summed over the world, count every token once."""
        rank_plan = self.plans.get(step)
        micro_batches = tuple(tuple(self._load(ps.sample.id, rank_plan) for ps in micro.samples)
                              for micro in rank_plan.group.micro_batches)
        batch = StepBatch(step=step, rank_plan=rank_plan, micro_batches=micro_batches)
        first = rank_plan.index_in_group == 0
        inputs = [item["inputs"] for micro in micro_batches for item in micro] if first else []
        ids = torch.cat(inputs) if inputs else torch.zeros(0, dtype=torch.long)  # type: ignore[arg-type]
        return {BATCH_KEY: batch, "input_ids": ids}

    def _load(self, sample_id: str, rank_plan: RankPlan) -> Item:
        if sample_id not in self.index_of:
            raise ValueError(f"step {rank_plan.step}: planned sample {sample_id!r} is not in the dataset")
        return self.to_item(self.dataset[self.index_of[sample_id]], sample_id=sample_id)


def single_item(batch: Sequence[dict[str, object]]) -> dict[str, object]:
    """``collate_fn`` of a DataLoader of batch size one over :class:`PlannedSteps`."""
    if len(batch) != 1:
        raise ValueError(f"a DCP step DataLoader has batch size 1, got {len(batch)} items")
    return batch[0]
