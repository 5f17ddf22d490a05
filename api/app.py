"""The FastAPI app of the planner service: ``create_app(settings)``.

Start it with ``dcp serve`` (uvicorn on 127.0.0.1:8000 by default). The lifespan opens and
migrates the SQLite store, starts the solver process pool, warms its workers, resumes the
epoch jobs a previous run left queued or running, and on shutdown stops the jobs (they
resume at next start) and the pool.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from api.auth import PUBLIC_PATHS
from api.deps import ServiceState, Writer
from api.errors import install_error_handlers
from api.fastpath import RankViewFastPath
from api.job_manager import JobManager, RetryPolicy
from api.lease import StoreLease
from api.limits import RequestGuardMiddleware
from api.metrics import LatencyMiddleware, Metrics
from api.pool import SolverPool
from api.recalibration import Recalibrator
from api.redoc_page import install_redoc
from api.registry import CostModelRegistry
from api.routers import (
    cost_models,
    dashboard,
    epochs,
    health,
    measurements,
    plan_measurements,
    plans,
    presets,
    report,
)
from api.settings import Settings
from api.store import PlanStore

logger = logging.getLogger(__name__)

API_VERSION = "1"

JOB_STOP_S = 3.0
"""At shutdown, how long the epoch jobs get to record that they stopped (after the pool's workers
were killed, their threads wake at once; a store locked by another process can hold them)."""

STORE_THREADS = 64
"""Threads of the event loop's default executor (store reads and writes, large-body parsing)."""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service app for ``settings`` (read from the environment when None)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Store calls run on threads: enough of them that requests waiting on a locked store
        # (up to DCP_STORE_BUSY_TIMEOUT_S each) cannot starve the other reads.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=STORE_THREADS, thread_name_prefix="dcp-store"))
        lease = StoreLease(settings.db_path).acquire() if settings.store_lease else None
        store = PlanStore.open(settings.db_path, busy_timeout_s=settings.store_busy_timeout_s)
        registry = CostModelRegistry(store)
        executor = SolverPool(settings.num_workers, nice=settings.worker_nice)
        metrics: Metrics = app.state.metrics
        metrics.plans_stored.set_function(lambda: float(store.num_plans()))
        job_executor: Executor = executor
        if settings.ray_address:  # Ray is imported only then (dcp-planner[ray])
            from api.ray_runner import service_executor

            job_executor = service_executor(address=settings.ray_address,
                                            steps_per_task=settings.ray_steps_per_task)
        jobs = JobManager(store, get_cost_model=registry.get, executor=job_executor,
                          num_workers=settings.num_workers,
                          write_batch_steps=settings.write_batch_steps, metrics=metrics,
                          retry=RetryPolicy(max_transient_retries=settings.job_max_transient_retries,
                                            max_backoff_s=settings.job_max_backoff_s,
                                            deadline_margin_s=settings.plan_deadline_margin_s))
        recalibrator = Recalibrator(store=store, get_cost_model=registry.get, pool=executor, metrics=metrics)
        state = ServiceState(settings=settings, store=store, registry=registry, executor=executor,
                             jobs=jobs, metrics=metrics, recalibrator=recalibrator)
        app.state.service = state

        async def warm() -> None:
            # Ready once every worker has imported the planner (a worker killed while starting is
            # replaced by the pool; readiness waits for its successor).
            while not executor.health().ok:
                await asyncio.sleep(0.05)
            state.ready = True
            # Long-lived start-up objects leave the collector's view: shorter GC pauses on the
            # request path.
            gc.collect()
            gc.freeze()
            logger.info("solver pool ready: %d worker(s) %s", settings.num_workers, sorted(executor.worker_pids()))

        warm_task = asyncio.create_task(warm())
        if settings.resume_jobs:
            resumed = await asyncio.to_thread(jobs.resume_all)
            if resumed:
                logger.info("resumed %d epoch job(s): %s", len(resumed), resumed)
        logger.info("planner service: store %s, %d solver worker(s)", settings.db_path,
                    settings.num_workers)
        try:
            yield
        finally:
            warm_task.cancel()
            # Bounded whatever the workers do: the jobs are told to stop, the pool's workers are
            # killed (nothing awaits what they run: the requests have ended, and a job's
            # unfinished steps are planned again when it resumes), then the job threads, which
            # wake on their failed futures, record the shutdown.
            jobs.request_shutdown()
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True, kill_running=True)
            await asyncio.to_thread(jobs.shutdown, timeout_s=JOB_STOP_S)
            if job_executor is not executor:
                await asyncio.to_thread(job_executor.shutdown)
            await asyncio.to_thread(recalibrator.shutdown)
            store.close()
            if lease is not None:
                lease.release()
            logger.info("planner service stopped")

    # /docs and /redoc load Swagger UI and ReDoc from the installed package, not from a CDN;
    # /redoc is api.redoc_page's (the bundle's logo served here too).
    app = FastAPIOffline(
        redoc_url=None,
        title="dcp-planner service",
        version=API_VERSION,
        summary="Per-step sequence-parallel plans for variable-length training: plan a batch, "
                "precompute an epoch, serve plans to ranks.",
        lifespan=lifespan,
        static_url="/docs-assets",
        swagger_ui_parameters={"validatorUrl": None},
        dependencies=[Writer],  # every route's token check (api.auth), documented in the OpenAPI document
    )
    install_redoc(app, favicon_url="/docs-assets/favicon.png")
    _document_public_routes(app)
    app.state.metrics = Metrics()
    for router in (plans.router, epochs.router, report.router, cost_models.router, measurements.router,
                   plan_measurements.router, presets.router, health.router, dashboard.router):
        app.include_router(router)

    def current_store() -> PlanStore | None:
        service: ServiceState | None = getattr(app.state, "service", None)
        return None if service is None else service.store

    def current_recalibrator() -> Recalibrator | None:
        service: ServiceState | None = getattr(app.state, "service", None)
        return None if service is None else service.recalibrator

    app.add_middleware(RankViewFastPath, get_store=current_store, get_recalibrator=current_recalibrator,
                       get_tokens=lambda: settings.tokens)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(RequestGuardMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_read_timeout_s=settings.body_read_timeout_s, tokens=settings.tokens,
                       max_bodies_per_client=settings.max_bodies_per_client,
                       max_body_bytes_in_flight=settings.max_body_bytes_in_flight)
    install_error_handlers(app)
    app.add_middleware(LatencyMiddleware, metrics=app.state.metrics)
    return app


def _document_public_routes(app: FastAPI) -> None:
    """The app-wide token dependency puts the bearer scheme on every operation of the OpenAPI
    document; the public routes (``api.auth.PUBLIC_PATHS``: health, readiness, the
    dashboard's static page) take no token, and their operations say so with an empty security
    requirement (schemathesis' ``ignored_auth`` flagged them as auth declared but not enforced)."""
    build = app.openapi

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            schema = build()
            paths: dict[str, dict[str, dict[str, object]]] = schema.get("paths", {})
            for path in PUBLIC_PATHS:
                for operation in paths.get(path, {}).values():
                    operation["security"] = []
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
