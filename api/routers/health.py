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


@router.get("/readyz", responses={503: {"description": "Starting: solver pool not warm yet."}})
async def readyz(state: State) -> dict[str, object]:
    """Readiness: the store answers and the solver pool is started."""
    await asyncio.to_thread(state.store.schema_version)
    if not state.ready:
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE, detail="starting")
    return {"status": "ready", "workers": state.settings.num_workers,
            "active_jobs": state.jobs.active()}


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    """Prometheus metrics: request latency, solver latency, plans stored, job progress."""
    # Rendering counts the stored plans (a store read): off the event loop.
    return Response(content=await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE_LATEST)
