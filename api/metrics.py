"""Prometheus metrics of the service, in a registry of their own (one per app)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CLIENT_CLOSED_STATUS = 499
"""The status label of a request the app returned from without answering (nginx's "client closed
request"): the client went, or the HTTP layer refused its body and answered itself."""
_SOLVER_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Request latency, solver latency, plans stored and job progress."""

    def __init__(self, *, plans_stored: Callable[[], float] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.request_latency_s = Histogram(
            "dcp_http_request_duration_seconds", "HTTP request latency by route.",
            ["method", "route", "status"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.solver_latency_s = Histogram(
            "dcp_solver_duration_seconds", "Planner wall time per plan.", ["kind"],
            buckets=_SOLVER_BUCKETS_S, registry=self.registry)
        self.plans_stored = Gauge("dcp_plans_stored", "Plans in the store (all epochs).",
                                  registry=self.registry)
        if plans_stored is not None:
            self.plans_stored.set_function(plans_stored)
        self.job_steps_done = Gauge("dcp_epoch_steps_done", "Steps planned and stored per epoch job.",
                                    ["epoch_id"], registry=self.registry)
        self.job_progress = Gauge("dcp_epoch_progress", "steps_done / steps_total per epoch job.",
                                  ["epoch_id"], registry=self.registry)
        self.bound_errors = Counter(
            "dcp_bound_errors", "Lower bounds found above a valid plan's step time and dropped (each a "
            "planner bug, logged with the batch digest), by kind and path.", ["kind", "path"],
            registry=self.registry)

    def count_dropped_bounds(self, kinds: tuple[str, ...], *, path: str) -> None:
        """Count the bounds a plan dropped (``StepResult.dropped_bounds``)."""
        for kind in kinds:
            self.bound_errors.labels(kind, path).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class LatencyMiddleware:
    """Pure ASGI middleware observing each HTTP request's latency under its route template."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        # An exception out of the app is a 500 on the wire (uvicorn answers it); an app that
        # returns without starting a response saw the client go (or the HTTP layer refuse the
        # body, as h11 does a malformed chunk, answering 400 itself): nginx's 499, not a 500.
        status = 500
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
            if not started:
                status = CLIENT_CLOSED_STATUS
        finally:
            path = scope.get("dcp.route") or getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.request_latency_s.labels(scope["method"], path, str(status)).observe(
                time.perf_counter() - start)
