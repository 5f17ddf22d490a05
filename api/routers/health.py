"""Health, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Response, status
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import State

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready, with the reasons: starting (solver "
                                                     "pool not warm yet), fewer solver workers alive "
                                                     "than configured, a solver task past its deadline, "
                                                     "an epoch job stalled."}})
async def readyz(state: State) -> dict[str, object]:
    """Readiness: the store answers, every configured solver worker is alive and ready, no solver
    task runs past its deadline (``api.pool.SolverPool.health``). 503 names each reason that holds;
    it is 200 again once the pool has replaced its workers."""
    await asyncio.to_thread(state.store.schema_version)
    if not state.ready:
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE, detail="starting")
    health = state.executor.health()
    if not health.ok:
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                            detail={"status": "not ready", "reasons": list(health.problems),
                                    "workers": health.num_workers, "workers_ready": health.num_ready})
    return {"status": "ready", "workers": health.num_workers, "workers_ready": health.num_ready,
            "active_jobs": state.jobs.active()}


@router.get("/metrics", response_class=Response,
            responses={401: {"description": "Without the bearer token when DCP_AUTH_TOKEN is set "
                                            "(the metrics name epochs)."}})
async def metrics(state: State) -> Response:
    """Prometheus metrics: request latency, solver latency, plans stored, job progress."""
    # Rendering counts the stored plans (a store read): off the event loop.
    return Response(content=await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE_LATEST)
