"""Recalibration jobs: measurements -> new cost-model revision (on the solver pool) -> re-plan.

``Recalibrator.maybe_start`` is called after measurements are stored; when an epoch has
``every_steps`` more measured steps than at its last fit, a thread of the service gathers the
measured groups with the micro-batches their plans gave them and submits the fit
(:func:`fit_revision_task`: the time factors from micro-batch times, ``costmodel.recalibrate``;
the factor on the bytes per token from step peaks where ranks report them,
``costmodel.recalibrate_memory``; the last ``FIT_WINDOW_STEPS`` measured steps) to the solver
pool: nothing of it runs
in a request. The fit becomes revision ``id@rev`` of the epoch's cost model (immutable, with
its held-out quality). An epoch that follows revisions then has every stored step above its
frozen step re-planned with the revision on the pool (same samples, same step seed) and
written only while still unfetched (``RevisionStore.replace_unfrozen``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import asdict
from typing import Any, TypeVar

from prometheus_client import Gauge

from api.jobs import planner_wall_cap_s
from api.measurements_store import GroupMeasurement, MeasurementStore
from api.metrics import Metrics
from api.plan_measurements import PlanMeasurementStore, micro_batch_fields, peak_record
from api.pool import SolverPool
from api.revisions_store import RecalibrationState, Revision, RevisionStore, split_ref
from api.store import PlanStore
from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.recalibrate import TERMS, TermScales, TermSplitter, fit_scales, scale_file
from costmodel.recalibrate_memory import MemoryFit, fit_activation_scale, step_peak_parts_bytes
from costmodel.ring.layout import GroupLayout
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.epoch import CancelledError, StepResult, StepTask, epoch_options, run_epoch
from planner.plan import GroupPlan, Plan

logger = logging.getLogger(__name__)

FIT_DEADLINE_S = 120.0
"""Wall-clock limit of one fit on the pool."""
REPLAN_WRITE_STEPS = 8
"""Most re-planned steps written per transaction (steps are submitted lowest first)."""
FIT_WINDOW_STEPS = 256
"""A fit uses the most recent measured steps (a drifting machine is followed; the work is bounded)."""
REPLAN_DEADLINE_MARGIN_S = 1.0
"""A re-planned step is stopped at the planner's wall cap plus this margin."""

T = TypeVar("T")


def recent(groups: Sequence[GroupMeasurement], num_steps: int) -> list[GroupMeasurement]:
    """The groups of the ``num_steps`` highest measured steps."""
    steps = sorted({g.step for g in groups})[-num_steps:]
    keep = set(steps)
    return [g for g in groups if g.step in keep]


def _measured_groups(groups: Sequence[GroupMeasurement], plans: dict[int, Plan]
                     ) -> Iterator[tuple[GroupMeasurement, GroupPlan]]:
    """Each measured group with its group in the plan it measured (groups whose plan is not the
    one measured, by digest, are left out: they cannot happen for accepted measurements of a
    frozen step)."""
    for g in groups:
        plan = plans.get(g.step)
        if plan is None or plan.digest() != g.digest:
            continue
        group = next((x for x in plan.groups if x.first_rank == g.first_rank), None)
        if group is not None:
            yield g, group


def observations(groups: Sequence[GroupMeasurement], plans: dict[int, Plan]) -> list[dict[str, Any]]:
    """One record per measured micro-batch: its samples, policies, group and measured time
    (groups whose micro-batch count differs from their plan's are left out)."""
    out = []
    for g, group in _measured_groups(groups, plans):
        if len(group.micro_batches) != len(g.times_s):
            continue
        for mb, measured in zip(group.micro_batches, g.times_s, strict=True):
            out.append({"step": g.step, "first_rank": g.first_rank, "group_size": group.size,
                        "ring_degree": group.ring_degree, **micro_batch_fields(mb),
                        "predicted_s": mb.predicted_time_s, "measured_s": measured})
    return out


def peak_observations(groups: Sequence[GroupMeasurement], plans: dict[int, Plan]) -> list[dict[str, Any]]:
    """One record per measured group step with a peak (CUDA ranks report one, CPU ranks none or
    0): its micro-batches' samples and policies and the largest peak of its ranks."""
    return [peak_record(g.step, group, g.peak_bytes)
            for g, group in _measured_groups(groups, plans) if g.peak_bytes and group.micro_batches]


def _layout(model: CostModel, record: dict[str, Any]) -> GroupLayout | None:
    """A measured group's Ulysses x ring layout on its placement (None: pure Ulysses; records
    stored before layouts existed have no ``ring_degree``)."""
    ring_degree = int(record.get("ring_degree", 1))
    if ring_degree == 1:
        return None
    return model.place(first_rank=record["first_rank"], group_size=record["group_size"], ring_degree=ring_degree)


def _fit_memory(model: CostModel, peaks: Sequence[dict[str, Any]], prior: float) -> MemoryFit:
    parts = [step_peak_parts_bytes(model, [([Sample.model_validate(s) for s in mb["samples"]], mb["policies"])
                                           for mb in p["micro_batches"]], group_size=p["group_size"],
                                   layout=_layout(model, p))
             for p in peaks]
    return fit_activation_scale([f for f, _ in parts], [v for _, v in parts], [p["peak_bytes"] for p in peaks],
                                prior=prior)


def fit_revision_task(base_json: str, cluster_json: str, records: list[dict[str, Any]],
                      prior: dict[str, float], peaks: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Fit per-term time factors on measured micro-batches and, from measured step peaks, the
    memory factor (runs in a pool worker).

    Returns:
        ``{"scales": {...}, "quality": {...}}`` (``quality["memory"]``: the memory fit, None
        without peaks).
    """
    import numpy as np

    base = CostModelFile.model_validate_json(base_json)
    cluster = ClusterSpec.model_validate_json(cluster_json)
    model = CostModel(file=base, cluster=cluster)
    split = TermSplitter(model)
    parts = [split.split([Sample.model_validate(s) for s in r["samples"]], group_size=r["group_size"],
                         recompute_layers=r["policies"],
                         num_nodes=r.get("num_nodes") or nodes_spanned(
                             first_rank=r["first_rank"], group_size=r["group_size"],
                             gpus_per_node=cluster.gpus_per_node),
                         layout=_layout(model, r))  # each group on its own layout
             for r in records]
    prior_scales = TermScales(**prior)
    fit = fit_scales(np.array([t for t, _ in parts]), np.array([r["measured_s"] for r in records]),
                     steps=[r["step"] for r in records], prior=prior_scales,
                     fixed_s=np.array([rest for _, rest in parts]))
    memory = None
    if peaks:
        try:
            memory = _fit_memory(model, peaks, prior_scales.activation)
        except ValueError:  # peaks the fit refuses never cost the time factors
            logger.exception("memory fit on %d step peaks refused; factor kept", len(peaks))
    scales = fit.scales.as_dict()
    if memory is not None:
        scales["activation"] = memory.factor
    return {"scales": scales, "quality": {**asdict(fit.quality), "memory": None if memory is None else asdict(memory)}}


class Recalibrator:
    """Runs recalibrations and re-plans on threads of the service, the work on the pool."""

    def __init__(self, *, store: PlanStore, get_cost_model: Callable[[str], CostModelFile],
                 pool: SolverPool, metrics: Metrics | None = None) -> None:
        self.store = store
        self.measurements = MeasurementStore(store)
        self.revisions = RevisionStore(store)
        self.plan_measurements = PlanMeasurementStore(store)
        self.get_cost_model = get_cost_model
        self.pool = pool
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._again: set[str] = set()
        self._closed = threading.Event()
        self.term_ratio: Gauge | None = None
        self.epoch_revision: Gauge | None = None
        if metrics is not None:
            self.term_ratio = Gauge(
                "dcp_cost_model_term_ratio", "Predicted / measured time per term of a cost model "
                "(1 / the newest revision's factor).", ["cost_model_id", "term"], registry=metrics.registry)
            self.epoch_revision = Gauge("dcp_epoch_cost_model_revision",
                                        "Cost-model revision of an epoch's newest plans.", ["epoch_id"],
                                        registry=metrics.registry)

    # ----------------------------------------------------------- scheduling
    def due(self, epoch_id: str, state: RecalibrationState | None = None) -> bool:
        """True when the epoch has ``every_steps`` more measured steps than at its last fit."""
        state = state or self.revisions.state(epoch_id)
        if state.every_steps <= 0:
            return False
        return self.measurements.measured_steps(epoch_id) - state.steps_at_fit >= state.every_steps

    def maybe_start(self, epoch_id: str) -> str:
        """Start a recalibration when due: ``off``, ``not due``, ``scheduled`` or ``running``."""
        state = self.revisions.state(epoch_id)
        if state.every_steps <= 0:
            return "off"
        with self._lock:
            if epoch_id in self._running:
                self._again.add(epoch_id)
                return "running"
            if not self.due(epoch_id, state):
                return "not due"
            thread = threading.Thread(target=self._loop, args=(epoch_id,), name=f"recal-{epoch_id}",
                                      daemon=True)
            self._running[epoch_id] = thread
        thread.start()
        return "scheduled"

    def _loop(self, epoch_id: str) -> None:
        try:
            while not self._closed.is_set():
                try:
                    self.recalibrate(epoch_id)
                except Exception:
                    logger.exception("epoch %s: recalibration failed", epoch_id)
                with self._lock:
                    if epoch_id not in self._again or not self.due(epoch_id):
                        self._again.discard(epoch_id)
                        return
                    self._again.discard(epoch_id)
        finally:
            with self._lock:
                self._running.pop(epoch_id, None)

    def busy(self, epoch_id: str) -> bool:
        """True while a recalibration of the epoch runs."""
        with self._lock:
            return epoch_id in self._running

    def shutdown(self, *, timeout_s: float = 30.0) -> None:
        """Let running recalibrations finish (at most ``timeout_s``)."""
        self._closed.set()
        with self._lock:
            threads = list(self._running.values())
        for thread in threads:
            thread.join(timeout=timeout_s)
        self.revisions.close()

    # --------------------------------------------------------------- work
    def _plans(self, epoch_id: str, steps: set[int]) -> dict[int, Plan]:
        found = {}
        for step in sorted(steps):
            row = self.store.get_plan(epoch_id, step)
            if row is not None:
                found[step] = Plan.model_validate_json(row[1])
        return found

    def recalibrate(self, epoch_id: str) -> Revision | None:
        """Fit a new revision from the epoch's measurements; re-plan when the epoch follows.

        Returns:
            The new revision, or None when there was nothing to fit.
        """
        record = self.store.get_epoch(epoch_id)
        if record is None:
            raise KeyError(f"unknown epoch {epoch_id!r}")
        state = self.revisions.state(epoch_id)
        measured_steps = self.measurements.measured_steps(epoch_id)
        groups = recent(self.measurements.groups(epoch_id), FIT_WINDOW_STEPS)
        plans = self._plans(epoch_id, {g.step for g in groups})
        records, peaks = observations(groups, plans), peak_observations(groups, plans)
        if not records:
            return None
        base_name, start_rev = split_ref(record.spec["cost_model_id"])  # an epoch may start at id@rev
        base = self.get_cost_model(base_name)
        prior = self._scales(base.id, state.current_rev or start_rev)
        cluster_json = ClusterSpec.model_validate(record.spec["cluster"]).model_dump_json()
        future: Future[dict[str, Any]] = self.pool.submit_with_deadline(
            FIT_DEADLINE_S, fit_revision_task, base.model_dump_json(), cluster_json, records, prior.as_dict(),
            peaks)
        result = future.result()
        scales = TermScales(**result["scales"])
        quality = result["quality"]

        def make_file(rev: int) -> CostModelFile:
            return scale_file(base, scales, new_id=f"{base.id}@{rev}",
                              note=f"recalibrated on {quality['num_points']} measured micro-batches of "
                                   f"epoch {epoch_id}: factors {scales.as_dict()}")

        revision = self.revisions.add_revision(base, make_file=make_file, scales=scales.as_dict(),
                                               fit=quality, source_epoch=epoch_id)
        logger.info("epoch %s: cost model %s, factors %s, held-out MAPE %s -> %s; memory %s", epoch_id,
                    revision.ref, scales.as_dict(), quality["heldout_mape_before"], quality["heldout_mape_after"],
                    quality["memory"])
        if self.term_ratio is not None:
            for term in TERMS:
                self.term_ratio.labels(base.id, term).set(1.0 / getattr(scales, term))
        self.revisions.record_fit(epoch_id, steps_at_fit=measured_steps,
                                  rev=revision.rev if state.follow else state.current_rev)
        if state.follow:
            self.replan(epoch_id, revision)
        if self.epoch_revision is not None:
            self.epoch_revision.labels(epoch_id).set(self.revisions.state(epoch_id).current_rev)
        return revision

    def recalibrate_plans(self, cost_model_id: str) -> Revision | None:
        """Fit a new revision of a cost model from its measured one-off plans (on the pool).

        Returns:
            The revision, or None when no one-off plan of the model was measured.
        """
        records, peaks = self.plan_measurements.observations(cost_model_id)
        cluster_json = self.plan_measurements.cluster_json(cost_model_id)
        if not records or cluster_json is None:
            return None
        base = self.get_cost_model(cost_model_id)
        latest = self.revisions.latest(base.id)
        prior = TermScales(**latest.scales) if latest is not None else TermScales()
        future: Future[dict[str, Any]] = self.pool.submit_with_deadline(
            FIT_DEADLINE_S, fit_revision_task, base.model_dump_json(), cluster_json, records, prior.as_dict(),
            peaks)
        result = future.result()
        scales, quality = TermScales(**result["scales"]), result["quality"]

        def make_file(rev: int) -> CostModelFile:
            return scale_file(base, scales, new_id=f"{base.id}@{rev}",
                              note=f"recalibrated on {quality['num_points']} measured micro-batches of "
                                   f"one-off plans: factors {scales.as_dict()}")

        revision = self.revisions.add_revision(base, make_file=make_file, scales=scales.as_dict(),
                                               fit=quality, source_epoch=None)
        if self.term_ratio is not None:
            for term in TERMS:
                self.term_ratio.labels(base.id, term).set(1.0 / getattr(scales, term))
        logger.info("cost model %s from one-off plans: factors %s, held-out MAPE %s -> %s", revision.ref,
                    scales.as_dict(), quality["heldout_mape_before"], quality["heldout_mape_after"])
        return revision

    def _scales(self, cost_model_id: str, rev: int) -> TermScales:
        if rev == 0:
            return TermScales()
        for r in self.revisions.revisions(cost_model_id):
            if r.rev == rev:
                return TermScales(**r.scales)
        return TermScales()

    def replan(self, epoch_id: str, revision: Revision) -> tuple[list[int], list[int]]:
        """Re-plan every stored step above the frozen step with ``revision`` (on the pool, at most
        two steps per worker in flight, each under the planner's wall cap plus a margin).

        Returns:
            ``(steps replaced, steps left: fetched meanwhile)``.
        """
        record = self.store.get_epoch(epoch_id)
        assert record is not None
        frozen = self.revisions.state(epoch_id).frozen_through
        steps = sorted(s for s in self.store.digests(epoch_id) if s > frozen)
        cluster = ClusterSpec.model_validate(record.spec["cluster"])
        cluster_json, file_json = cluster.model_dump_json(), revision.file.model_dump_json()
        options, seed = epoch_options(record.spec), record.spec["seed"]
        tasks = (StepTask(step=s, samples_json=self.store.batch_json(epoch_id, s), cluster_json=cluster_json,
                          cost_model_json=file_json, options=options, seed=seed) for s in steps)
        deadline_s = planner_wall_cap_s(options, num_gpus=cluster.num_gpus) + REPLAN_DEADLINE_MARGIN_S
        sink = _ReplanSink(self.revisions, epoch_id, revision.rev)
        try:
            run_epoch(tasks, executor=_Deadline(self.pool, deadline_s), sink=sink,
                      max_in_flight=2 * self.pool.num_workers, write_batch_steps=REPLAN_WRITE_STEPS,
                      should_stop=self._closed.is_set)
        except CancelledError:
            logger.info("epoch %s: re-planning with %s stopped at shutdown", epoch_id, revision.ref)
        logger.info("epoch %s: re-planned %d steps with %s (%d fetched meanwhile, left as they were)",
                    epoch_id, len(sink.replaced), revision.ref, len(sink.left))
        return sink.replaced, sink.left


class _ReplanSink:
    """``planner.epoch.StepSink`` writing re-planned steps only while no rank has fetched them."""

    def __init__(self, revisions: RevisionStore, epoch_id: str, rev: int) -> None:
        self.revisions, self.epoch_id, self.rev = revisions, epoch_id, rev
        self.replaced: list[int] = []
        self.left: list[int] = []

    def write_steps(self, results: Sequence[StepResult]) -> int:
        done, kept = self.revisions.replace_unfrozen(self.epoch_id, results, rev=self.rev)
        self.replaced += done
        self.left += kept
        return len(done)


class _Deadline(Executor):
    """Submits every task to the pool under one wall-clock deadline."""

    def __init__(self, pool: SolverPool, deadline_s: float) -> None:
        self.pool, self.deadline_s = pool, deadline_s

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self.pool.submit_with_deadline(self.deadline_s, fn, *args, **kwargs)
