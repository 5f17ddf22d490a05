"""Epoch steps as Ray tasks: the Ray backend beside the process pool (``dcp-planner[ray]``).

``RayStepExecutor`` is a ``concurrent.futures.Executor`` that ``planner.epoch.run_epoch`` (and
so ``api.jobs.run_epoch_job``) drives exactly like the process pool: one future per step,
results written to the plan store by the caller in the same small transactions. Underneath:

* the job's shared inputs (cluster, cost model, options, seed, deadline) are put in the
  object store once per job and passed to every task by reference;
* steps are grouped ``steps_per_task`` to a Ray task (a batch fills as the caller submits;
  a partial one leaves after ``LINGER_S``), so scheduling costs little per step;
* a worker or node killed mid-task makes Ray run the task again (``max_retries``); a step's
  future is resolved once, and the store ignores a step it already holds, so nothing is
  stored twice;
* a cluster that cannot be reached, or is lost mid-job (its GCS port silent for
  ``LOST_AFTER_PROBES`` probes, ``api.ray_health``), fails the step futures with
  :class:`api.faults.ClusterUnavailableError` (a transient fault: the service retries the
  job with backoff and reconnects, ``dcp epoch`` run again resumes from the stored steps);
* steps whose futures were cancelled (a cancelled or failed job) are not sent.

Workers run the same ``planner.epoch.plan_step`` as the pool, so plans and digests equal the
process pool's for the same seed. Ray is imported only when an executor is created: the
service and the CLI run without it unless a Ray address is given. The cluster's nodes need the
same dcp-planner installed as the driver.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, TypeVar

from api.faults import ClusterUnavailableError
from api.ray_config import LOCAL, RayConfig, host_port
from api.ray_health import ClusterWatch
from api.ray_tasks import SharedInputs, plan_step_batch
from planner.epoch import StepTask, plan_step

logger = logging.getLogger(__name__)

T = TypeVar("T")

LINGER_S = 0.02
"""Longest time a partly filled batch waits for more steps before it is sent."""
POLL_S = 0.05
"""Longest wait of the collector thread on running tasks before it looks for new batches."""
GCS_RECONNECT_TIMEOUT_S = 365 * 24 * 3600
"""Ray ends a driver process whose GCS stays away 60 s (``RAY_gcs_rpc_server_reconnect_timeout_s``);
the service must outlive its cluster, so the driver waits this long (the probes decide instead)."""
class RayNotInstalledError(RuntimeError):
    """Ray was asked for but is not installed."""


@dataclass(slots=True)
class _Batch:
    shared: SharedInputs
    opened_monotonic: float
    steps: list[tuple[int, str]] = field(default_factory=list)
    futures: list[Future[Any]] = field(default_factory=list)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError("a Ray address was given but Ray is not installed: "
                                   "pip install 'dcp-planner[ray]'") from exc
    return ray


class RayStepExecutor(Executor):
    """Runs ``plan_step`` calls as batched Ray tasks; one future per step (see the module doc)."""

    def __init__(self, config: RayConfig) -> None:
        self.config = config
        self._ray = _import_ray()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._connected = False
        self._owns_ray = False
        self._broken: str | None = None
        self._remote: Any = None
        self._shared_refs: dict[SharedInputs, Any] = {}
        self._open: dict[SharedInputs, _Batch] = {}
        self._inflight: dict[Any, list[Future[Any]]] = {}
        self._collector: threading.Thread | None = None
        self._watch = ClusterWatch(None)
        self.num_tasks_sent = 0
        self.num_cluster_failures = 0

    # --- connection -------------------------------------------------------------------------

    def connect(self) -> None:
        """Connect to the cluster (a no-op when connected).

        Raises:
            api.faults.ClusterUnavailableError: the cluster cannot be reached (named, with the cause).
        """
        ray = self._ray
        with self._lock:
            if self._connected and self._broken is None:
                return
            if self._broken is not None and self._owns_ray:
                logger.warning("ray: reconnecting to %s after: %s", self.config.address, self._broken)
                ray.shutdown()
                self._connected = self._owns_ray = False
                self._shared_refs.clear()
            address = self.config.address
            if address not in ("auto", LOCAL):
                host, port = host_port(address)
                try:
                    socket.create_connection((host, port), timeout=self.config.connect_timeout_s).close()
                except OSError as exc:
                    raise ClusterUnavailableError(
                        f"the Ray cluster at {address!r} is unreachable ({exc}); check --ray-address / "
                        "DCP_RAY_ADDRESS and that the cluster is up (ray start --head)") from None
            if not ray.is_initialized():
                kwargs: dict[str, Any] = {"namespace": "dcp-planner", "log_to_driver": False}
                if address == LOCAL:
                    kwargs.update(address=LOCAL, num_cpus=self.config.local_num_cpus, include_dashboard=False)
                else:
                    kwargs["address"] = address
                    # Read by Ray's core worker at init (see GCS_RECONNECT_TIMEOUT_S).
                    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_RECONNECT_TIMEOUT_S))
                # ray.init replaces the SIGTERM handler with sys.exit: keep the service's (uvicorn's
                # graceful shutdown: jobs stop after writing their finished steps).
                main = threading.current_thread() is threading.main_thread()
                previous = signal.getsignal(signal.SIGTERM) if main else None
                try:
                    ray.init(**kwargs)
                except Exception as exc:
                    raise ClusterUnavailableError(
                        f"could not connect to the Ray cluster at {address!r}: {type(exc).__name__}: {exc}"
                    ) from None
                finally:
                    if previous is not None:
                        signal.signal(signal.SIGTERM, previous)
                self._owns_ray = True
            self._remote = ray.remote(max_retries=self.config.max_retries, retry_exceptions=False,
                                      num_cpus=1)(plan_step_batch)
            self._connected = True
            self._broken = None
            self._watch = ClusterWatch.of(self._ray, self.config.address)
        logger.info("ray: connected to %s (%s CPUs)", address, self._ray.cluster_resources().get("CPU"))

    def num_cpus(self) -> int:
        """CPUs of the cluster now (at least 1; connects first).

        Raises:
            api.faults.ClusterUnavailableError: the cluster cannot be reached.
        """
        self.connect()
        try:
            return max(1, int(self._ray.cluster_resources().get("CPU", 0)))
        except Exception as exc:
            raise ClusterUnavailableError(f"the Ray cluster at {self.config.address!r} does not answer: "
                                          f"{type(exc).__name__}: {exc}") from None

    def num_slots(self) -> int:
        """Steps to keep submitted for the cluster to stay busy, halved (the caller doubles it).

        Raises:
            api.faults.ClusterUnavailableError: the cluster cannot be reached.
        """
        return self.num_cpus() * self.config.steps_per_task

    # --- submission -------------------------------------------------------------------------

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``plan_step(task)`` for a Ray task (only ``plan_step`` of a ``StepTask``)."""
        return self.submit_with_deadline(None, fn, *args, **kwargs)

    def submit_with_deadline(self, deadline_s: float | None, fn: Callable[..., T], /, *args: Any,
                             **kwargs: Any) -> Future[T]:
        """Queue ``plan_step(task)``; each step is stopped ``deadline_s`` after its start.

        Raises:
            TypeError: for any other call than ``plan_step(task)``.
            api.faults.ClusterUnavailableError: when the cluster cannot be reached.
        """
        if fn is not plan_step or kwargs or len(args) != 1 or not isinstance(args[0], StepTask):
            raise TypeError("RayStepExecutor runs plan_step(StepTask) only")
        task: StepTask = args[0]
        if self._closed:
            raise RuntimeError("the Ray executor is shut down")
        self.connect()
        shared = SharedInputs(cluster_json=task.cluster_json, cost_model_json=task.cost_model_json,
                              options_json=json.dumps(dict(task.options), sort_keys=True), seed=task.seed,
                              deadline_s=deadline_s)
        future: Future[T] = Future()
        with self._lock:
            batch = self._open.get(shared)
            if batch is None:
                batch = self._open[shared] = _Batch(shared=shared, opened_monotonic=time.monotonic())
            batch.steps.append((task.step, task.samples_json))
            batch.futures.append(future)
            if len(batch.steps) >= self.config.steps_per_task:
                del self._open[shared]
                self._send(batch)
            if self._collector is None or not self._collector.is_alive():
                self._collector = threading.Thread(target=self._collect, name="ray-collector", daemon=True)
                self._collector.start()
        self._wake.set()
        return future

    def _send(self, batch: _Batch) -> None:
        """Start a Ray task for the batch (lock held); none on a cluster known to be lost."""
        live = [i for i, future in enumerate(batch.futures) if not future.cancelled()]
        if len(live) < len(batch.futures):
            batch.steps = [batch.steps[i] for i in live]
            batch.futures = [batch.futures[i] for i in live]
            if not live:
                return
        if self._broken is not None:
            lost = ClusterUnavailableError(f"the Ray cluster at {self.config.address!r} is lost ({self._broken})")
            for future in batch.futures:
                _settle(future, lost)
            return
        try:
            ref = self._shared_refs.get(batch.shared)
            if ref is None:
                if len(self._shared_refs) >= 16:
                    self._shared_refs.clear()
                ref = self._shared_refs[batch.shared] = self._ray.put(batch.shared)
            task_ref = self._remote.remote(ref, batch.steps)
        except Exception as exc:
            self._fail(batch.futures, exc)
            return
        self._inflight[task_ref] = batch.futures
        self.num_tasks_sent += 1

    # --- results ----------------------------------------------------------------------------

    def _collect(self) -> None:
        """The collector thread: sends lingering batches, settles finished ones, watches the cluster."""
        while not self._closed:
            try:
                self._collect_loop()
            except Exception:  # never leave futures unsettled because this thread died
                logger.exception("ray: collector error; continuing")
                time.sleep(POLL_S)

    def _collect_loop(self) -> None:
        ray = self._ray
        self._watch.reset()
        while not self._closed:
            with self._lock:
                now = time.monotonic()
                for key, batch in list(self._open.items()):
                    if now - batch.opened_monotonic >= LINGER_S:
                        del self._open[key]
                        self._send(batch)
                refs = list(self._inflight)
                idle = not refs and not self._open
            if idle:
                self._wake.wait(POLL_S)
                self._wake.clear()
                continue
            if not refs:
                time.sleep(LINGER_S / 2)
                continue
            silent = self._watch.lost()
            if silent is not None:
                with self._lock:
                    lost = [f for r in refs for f in self._inflight.pop(r, [])]
                self._fail(lost, ConnectionError(silent))
                continue
            try:
                ready, rest = ray.wait(refs, num_returns=1, timeout=POLL_S, fetch_local=True)
                if ready and rest:
                    more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=True)
                    ready += more
            except Exception as exc:  # the cluster itself is gone
                with self._lock:
                    lost = [f for r in refs for f in self._inflight.pop(r, [])]
                self._fail(lost, exc)
                continue
            for ref in ready:
                with self._lock:
                    futures = self._inflight.pop(ref, [])
                try:
                    outcomes = ray.get(ref)
                except Exception as exc:
                    self._fail(futures, exc)
                    continue
                for future, outcome in zip(futures, outcomes, strict=True):
                    _settle(future, outcome)

    def _fail(self, futures: list[Future[Any]], exc: BaseException) -> None:
        """Fail the futures of a batch whose task could not run (Ray's own errors)."""
        ray = self._ray
        system = not isinstance(exc, ray.exceptions.RayTaskError)
        if system:
            self.num_cluster_failures += 1
            self._broken = f"{type(exc).__name__}: {exc}"[:300]
            error: BaseException = ClusterUnavailableError(
                f"the Ray cluster at {self.config.address!r} failed mid-job ({self._broken}); "
                "the stored steps are kept and the job resumes from them")
        else:
            error = RuntimeError(f"a Ray task failed: {str(exc)[:500]}")
        logger.warning("ray: a batch of %d step(s) failed: %s", len(futures), error)
        for future in futures:
            _settle(future, error)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop collecting; cancel the tasks still running; disconnect if this executor connected."""
        self._closed = True
        self._wake.set()
        with self._lock:
            refs = list(self._inflight)
            futures = [f for fs in self._inflight.values() for f in fs]
            futures += [f for b in self._open.values() for f in b.futures]
            self._inflight.clear()
            self._open.clear()
        for future in futures:
            future.cancel()
        if self._collector is not None and wait:
            self._collector.join(timeout=5.0)
        if self._connected:
            for ref in refs:
                try:
                    self._ray.cancel(ref)
                except Exception as exc:
                    logger.debug("ray: cancel failed: %s", exc)
            if self._owns_ray:
                self._ray.shutdown()
            self._connected = False


def _settle(future: Future[Any], outcome: Any) -> None:
    """Give a step's future its result or exception, once (a cancelled or settled one is left)."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass


def connect_executor(config: RayConfig) -> RayStepExecutor:
    """A connected executor.

    Raises:
        RayNotInstalledError: Ray is not installed.
        api.faults.ClusterUnavailableError: the cluster cannot be reached.
    """
    executor = RayStepExecutor(config)
    executor.connect()
    return executor


def service_executor(*, address: str, steps_per_task: int) -> RayStepExecutor:
    """The epoch-job executor of the service (``DCP_RAY_ADDRESS``).

    A cluster unreachable at start is logged, not raised: the service starts (plans are still
    served), and each job fails with the cause as a transient fault, retried with backoff.

    Raises:
        ValueError: a malformed address.
        RayNotInstalledError: Ray is not installed (the service refuses to start).
    """
    executor = RayStepExecutor(RayConfig(address=address, steps_per_task=steps_per_task))
    try:
        executor.connect()
    except ClusterUnavailableError as exc:
        logger.error("DCP_RAY_ADDRESS: %s; epoch jobs fail and are retried until it answers", exc)
    return executor
