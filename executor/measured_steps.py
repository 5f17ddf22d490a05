"""Train an epoch's steps from the planner service with every micro-batch timed and posted.

What a rank runs when the service recalibrates online (``POST .../recalibration``): each step's
rank view is fetched, its micro-batches run through the :class:`~executor.runtime.Executor`
with a :class:`~executor.measure.StepTimer`, and the measurements go to the service in the
background (:class:`~executor.measure.MeasurementReporter`), one reporter per :meth:`run` so
that a run's measurements are all posted when it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from costmodel.specs import Sample
from executor.client import PlannerClient
from executor.groups import GroupRegistry
from executor.measure import MeasurementReporter, ReporterConfig, StepMeasurement, StepTimer
from executor.runtime import Executor, Item, MicroBatchWork
from executor.step_gc import StepGC

LossFn = Callable[[MicroBatchWork], torch.Tensor]
"""Forward of one micro-batch to its (already normalised) loss."""


class MeasuredSteps:
    """A rank's training loop over planned steps, measured and reported."""

    def __init__(self, client: PlannerClient, *, rank: int, registry: GroupRegistry,
                 weight_dtype: torch.dtype = torch.float32,
                 reporter: ReporterConfig | None = None, step_gc: StepGC | None = None) -> None:
        """Args:
            client: The rank's client of the planner service.
            rank: This rank.
            registry: The process groups of the world.
            weight_dtype: dtype of the loss weights (:class:`Executor`).
            reporter: How measurements are batched and posted.
            step_gc: Garbage collection at step boundaries (``executor.step_gc``; None:
                Python's automatic collector, whose pauses land inside measured micro-batches).
        """
        self.client, self.rank = client, rank
        self.reporter_config = reporter or ReporterConfig(batch_steps=4, flush_interval_s=0.5)
        self.timer = StepTimer(rank=rank, sink=self._sink)
        self.executor = Executor(registry=registry, weight_dtype=weight_dtype, timer=self.timer,
                                 step_gc=step_gc)
        self.reporters: list[MeasurementReporter] = []
        self.fetched: dict[str, dict[int, str]] = {}
        """Plan digest of every fetched step, per epoch."""

    def _sink(self, measurement: StepMeasurement) -> None:
        self.reporters[-1].submit(measurement)

    def run(self, epoch_id: str, steps: Iterable[int], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            load_sample: Callable[[Sample], Item], loss: LossFn, close_timeout_s: float = 60.0) -> None:
        """Train ``steps`` of ``epoch_id``; returns when every measurement was posted (or dropped).

        Args:
            epoch_id: The service's epoch.
            steps: Steps to run, in order.
            model: The model (its gradients are synced by the executor after each step).
            optimizer: Stepped once per step.
            load_sample: Loads one planned sample (:meth:`Executor.micro_batches`).
            loss: Forward of a micro-batch to its loss; the loop calls ``backward`` on it.
            close_timeout_s: How long to wait for the last posts.
        """
        self.reporters.append(MeasurementReporter(self.client, epoch_id=epoch_id, rank=self.rank,
                                                  config=self.reporter_config))
        fetched = self.fetched.setdefault(epoch_id, {})
        try:
            for step in steps:
                rank_plan = self.client.rank_plan(epoch_id, step, self.rank)
                fetched[step] = rank_plan.plan_digest
                self.executor.begin_step(rank_plan, step=step)
                optimizer.zero_grad(set_to_none=True)
                for work in self.executor.micro_batches(rank_plan, load_sample=load_sample):
                    loss(work).backward()
                self.executor.sync_gradients(model)
                optimizer.step()
            self.timer.flush()
        finally:
            self.reporters[-1].close(timeout_s=close_timeout_s)

    @property
    def num_posted_steps(self) -> int:
        """Steps whose measurements the service accepted, over every run."""
        return sum(r.num_posted_steps for r in self.reporters)

    @property
    def num_dropped_steps(self) -> int:
        """Steps whose measurements were given up, over every run."""
        return sum(r.num_dropped_steps for r in self.reporters)
