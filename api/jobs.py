"""Epoch jobs: creation (steps fixed up front), running over the process pool, resuming.

``prepare_epoch`` and ``run_epoch_job`` are shared by the service and ``dcp epoch``; the
service's ``api.job_manager.JobManager`` runs jobs on its threads, each driving the shared
process pool, and retries them. ``run_epoch_job`` tells failures apart by cause
(``api.faults.classify``): a passing fault (a killed solver worker, a full disk, a locked store)
leaves the job ``queued`` with the cause in ``error``, its stored steps kept; any other (a
sample that fits nowhere, a step past its deadline) fails it at once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from api.faults import classify
from api.metrics import Metrics
from api.registry import check_compatible
from api.store import EpochRecord, PlanStore
from costmodel.evaluate import CostModel
from costmodel.model_choice import check_samples_kind
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.epoch import (
    BatchRule,
    CancelledError,
    StepResult,
    StepTask,
    build_config,
    epoch_options,
    make_steps,
    run_epoch,
)
from planner.fit_check import check_samples_fit
from planner.layouts import config_layouts

logger = logging.getLogger(__name__)

T = TypeVar("T")


def manifest_digest(samples: Sequence[Sample]) -> str:
    """SHA-256 over the manifest's samples (ids and shapes, in order)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.model_dump_json(exclude_none=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def prepare_epoch(store: PlanStore, *, epoch_id: str, samples: Sequence[Sample], rule: BatchRule,
                  seed: int, cluster: ClusterSpec, cost_model: CostModelFile,
                  options: Mapping[str, Any], manifest_source: str,
                  model_source: str | None = None) -> EpochRecord:
    """Validate a job, cut the manifest into steps and store it as queued.

    ``model_source`` says where the model came from (``model llama-3.1-8b``, ``model_config
    <path>``); the spec keeps it with the model's name and kind beside the cost model's id and
    digest, by which a resume finds the same model.

    Raises:
        ValueError: invalid options, a cost model for other hardware, samples of the other kind
            than the model (text vs video, naming the first), a sample that fits nowhere
            (named, before anything is stored), a sample longer than the token budget, an
            empty manifest.
        api.store.EpochExistsError: when the id is taken.
    """
    config = build_config(options)
    check_compatible(cost_model, cluster)
    check_samples_kind(samples, cost_model.model, source="manifest")
    check_samples_fit(samples, cluster=cluster, cost_model=cost_model, config=config)
    steps = make_steps(samples, rule=rule, seed=seed)
    spec = {
        "batch": rule.as_dict(), "seed": seed, "cluster": cluster.model_dump(mode="json"),
        "cost_model_id": cost_model.id, "cost_model_digest": cost_model.digest(),
        "model": {"name": cost_model.model.name, "kind": cost_model.model.kind,
                  "source": model_source or f"cost model {cost_model.id}"},
        # the layout the options resolve to is stored, so the job plans as its declared layouts say
        # (a job stored without one predates the ``auto`` default: see planner.epoch.epoch_options)
        "options": _stored_options(options, config),
        # the (size, u, r) layouts its plans may use: an executor builds its process groups from them
        "layouts": [list(t) for t in config_layouts(CostModel(file=cost_model, cluster=cluster), config)],
        "manifest": {"source": manifest_source, "num_samples": len(samples),
                     "digest": manifest_digest(samples)},
    }
    return store.create_epoch(epoch_id, spec=spec, steps=steps)


def _stored_options(options: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """A job's options as stored: the request's, with the layout its config resolved to."""
    return {"layout": config.layout, **options}


def same_request(record: EpochRecord, *, rule: BatchRule, seed: int, cluster: ClusterSpec,
                 cost_model: CostModelFile, options: Mapping[str, Any],
                 samples: Sequence[Sample]) -> bool:
    """True when a stored job was made from exactly these inputs (so it may be resumed)."""
    spec = record.spec
    return (spec["batch"] == rule.as_dict() and spec["seed"] == seed
            and spec["cluster"] == cluster.model_dump(mode="json")
            and spec["cost_model_digest"] == cost_model.digest()
            and epoch_options(spec) == _stored_options(options, build_config(options))
            and spec["manifest"]["digest"] == manifest_digest(samples))


def _tasks(store: PlanStore, record: EpochRecord, cluster: ClusterSpec,
           cost_model: CostModelFile) -> Iterator[StepTask]:
    cluster_json, cost_model_json = cluster.model_dump_json(), cost_model.model_dump_json()
    for step in store.pending_steps(record.id):
        yield StepTask(step=step, samples_json=store.batch_json(record.id, step),
                       cluster_json=cluster_json, cost_model_json=cost_model_json,
                       options=epoch_options(record.spec), seed=record.spec["seed"])


class _MeteredSink:
    def __init__(self, store: PlanStore, epoch_id: str, metrics: Metrics | None) -> None:
        self.store = store
        self.epoch_id = epoch_id
        self.metrics = metrics

    def write_steps(self, results: Sequence[StepResult]) -> int:
        new = self.store.write_steps(self.epoch_id, results)
        if self.metrics is not None:
            for r in results:
                self.metrics.solver_latency_s.labels("epoch").observe(r.solve_time_s)
                self.metrics.count_dropped_bounds(r.dropped_bounds, path="epoch")
        return new


def planner_wall_cap_s(options: Mapping[str, Any], *, num_gpus: int, num_samples: int | None = None) -> float:
    """The wall time the planner itself allows a plan with these options (before the margin).

    That is ``time_limit_s``, or ``exact_time_limit_s`` when larger and the exact CP-SAT model
    may run (CP-SAT on, at most ``exact_max_samples`` samples — any step size when None — and
    at most ``exact_max_ranks`` GPUs): ``planner.planning`` gives the exact model that budget.

    Raises:
        ValueError: for invalid options.
    """
    config = build_config(options)
    exact = (config.use_cpsat and num_gpus <= config.exact_max_ranks
             and (num_samples is None or num_samples <= config.exact_max_samples))
    return max(config.time_limit_s, config.exact_time_limit_s) if exact else config.time_limit_s


class _DeadlineExecutor(Executor):
    """Submits every task under one wall-clock deadline (to a ``SolverPool`` or a
    ``api.ray_runner.RayStepExecutor``: any executor with ``submit_with_deadline``)."""

    def __init__(self, pool: Any, deadline_s: float) -> None:
        self.pool = pool
        self.deadline_s = deadline_s

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self.pool.submit_with_deadline(self.deadline_s, fn, *args, **kwargs)


def record_state(store: PlanStore, epoch_id: str, state: str, **kwargs: Any) -> bool:
    """Record a final state; a store that cannot be written (full, locked) is logged, not raised:
    the job stays ``running`` in the file and is resumed at the next start.

    Returns:
        Whether the state was recorded.
    """
    try:
        store.set_state(epoch_id, state, **kwargs)
    except Exception as exc:
        logger.warning("epoch %s: could not record state %s: %s", epoch_id, state, classify(exc).message)
        return False
    return True


def run_epoch_job(store: PlanStore, epoch_id: str, *, get_cost_model: Callable[[str], CostModelFile],
                  executor: Executor, num_workers: int, write_batch_steps: int = 16,
                  should_stop: Callable[[], bool] = lambda: False,
                  stop_state: Callable[[], str] = lambda: "cancelled",
                  stop_error: Callable[[], str | None] = lambda: None,
                  on_written: Callable[[int], None] = lambda n: None,
                  metrics: Metrics | None = None, max_steps: int | None = None,
                  deadline_margin_s: float | None = None, requeue_transient: bool = False) -> EpochRecord:
    """Plan every step of a stored job that has no plan yet; record the final state.

    Args:
        store: The plan store.
        epoch_id: The job.
        get_cost_model: Resolves the job's cost-model id.
        executor: The process pool (or a ``RayStepExecutor``).
        num_workers: Its size (about twice as many steps are kept in flight; for Ray, its
            ``num_slots()``).
        write_batch_steps: Most steps per transaction.
        should_stop: Polled; true stops the job after writing what finished.
        stop_state: The state a stopped job gets (``cancelled``, or ``queued`` at shutdown).
        stop_error: Why it stopped, recorded as its ``error`` (None: nothing recorded); a passing
            fault met while stopping (a worker killed by the same signal that stops the
            service) is recorded as this stop, not as the fault.
        on_written: Called with the number of new steps after each write.
        metrics: Service metrics, if any.
        max_steps: Plan at most this many of the pending steps (the job stays queued).
        deadline_margin_s: With a ``SolverPool`` or Ray: each step is stopped at the planner's own
            wall cap (``planner_wall_cap_s``) plus this margin (None: no deadline).
        requeue_transient: A transient failure leaves the job ``queued`` (to be retried) instead
            of ``failed``; either way ``transient`` is recorded.

    Returns:
        The job as stored at the end (done, failed, cancelled or queued); after a failure the store
        could not record, the state and error it should have recorded.
    """
    record = store.get_epoch(epoch_id)
    if record is None:
        raise KeyError(f"unknown epoch {epoch_id!r}")
    try:
        store.set_state(epoch_id, "running")
        cost_model = get_cost_model(record.spec["cost_model_id"])
        if cost_model.digest() != record.spec["cost_model_digest"]:
            raise ValueError(f"cost model {cost_model.id!r} changed since the job was created")
        cluster = ClusterSpec.model_validate(record.spec["cluster"])
        if hasattr(executor, "num_slots"):  # a Ray cluster: its size now (it may have grown)
            num_workers = executor.num_slots()
        tasks = _tasks(store, record, cluster, cost_model)
        if max_steps is not None:
            tasks = itertools.islice(tasks, max_steps)
        if deadline_margin_s is not None and hasattr(executor, "submit_with_deadline"):
            limit_s = planner_wall_cap_s(record.spec["options"], num_gpus=cluster.num_gpus)
            executor = _DeadlineExecutor(executor, limit_s + deadline_margin_s)
        run_epoch(tasks, executor=executor,
                  sink=_MeteredSink(store, epoch_id, metrics), max_in_flight=2 * num_workers,
                  write_batch_steps=write_batch_steps, should_stop=should_stop,
                  on_written=on_written)
    except CancelledError:
        record_state(store, epoch_id, stop_state(), error=stop_error())
    except Exception as exc:
        fault = classify(exc)
        if fault.transient and should_stop():
            logger.info("epoch %s stopped (%s while stopping)", epoch_id, fault.message)
            record_state(store, epoch_id, stop_state(), error=stop_error())
            final = store.get_epoch(epoch_id)
            assert final is not None
            return final
        message = fault.message if fault.transient else f"{type(exc).__name__}: {exc}"
        logger.warning("epoch %s %s: %s", epoch_id, "interrupted" if fault.transient else "failed", message)
        state = "queued" if fault.transient and requeue_transient else "failed"
        if not record_state(store, epoch_id, state, error=message, transient=fault.transient):
            # The store is the fault (or locked): return what it could not record, cause included.
            stored = store.get_epoch(epoch_id)
            assert stored is not None
            return dataclasses.replace(stored, state=state, error=message, transient=fault.transient)
    else:
        done = store.get_epoch(epoch_id)
        complete = done is not None and done.steps_done >= done.steps_total
        record_state(store, epoch_id, "done" if complete else "queued")
    final = store.get_epoch(epoch_id)
    assert final is not None
    return final
