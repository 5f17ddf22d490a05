"""HTTP client of the planner service, with retry, deadline and per-rank prefetch.

:class:`PlannerClient` wraps one pooled ``httpx.Client``. Every call retries connection errors,
timeouts, a 404 with Retry-After (a step still being planned), 408/425/429 and 5xx with exponential
backoff and full jitter until its deadline; then it raises :class:`PlanUnavailableError`
naming the URL, the attempts, the time spent and the last error. Other 4xx answers are the
caller's mistake and raise :class:`PlanRequestError` at once.

:class:`PlanPrefetcher` keeps the next ``depth`` steps of one rank in flight on a background
thread so that the training loop rarely waits, and can fall back to a user-supplied local
planner (dependency injection: this package never imports the solver) when the service stays
unreachable past the deadline.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from planner.plan import Plan, RankPlan

logger = logging.getLogger(__name__)

_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


@dataclass(kw_only=True, frozen=True, slots=True)
class RetryPolicy:
    """How long and how often to retry the service."""

    deadline_s: float = 30.0
    """Give up on a call after this many seconds (from its first attempt)."""
    initial_backoff_s: float = 0.05
    """Backoff before the second attempt; doubles after each failure."""
    max_backoff_s: float = 2.0
    """Largest backoff between attempts."""
    request_timeout_s: float = 10.0
    """Timeout of one HTTP request."""

    def __post_init__(self) -> None:
        for name in ("deadline_s", "initial_backoff_s", "max_backoff_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(f"max_backoff_s={self.max_backoff_s} < initial_backoff_s="
                             f"{self.initial_backoff_s}")


class PlanUnavailableError(RuntimeError):
    """The service did not answer usefully before the deadline."""


class PlanRequestError(ValueError):
    """The service rejected the request (a 4xx that retrying cannot fix)."""


class PlannerClient:
    """One pooled HTTP client of the planner service (thread-safe)."""

    def __init__(self, base_url: str, *, retry: RetryPolicy | None = None,
                 auth_token: str | None = None, transport: httpx.BaseTransport | None = None) -> None:
        """Connect lazily to ``base_url`` (e.g. ``http://127.0.0.1:8000``)."""
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, transport=transport,
                                  timeout=self.retry.request_timeout_s)
        self._stop = threading.Event()

    def close(self) -> None:
        """Stop pending retries and close the connection pool."""
        self._stop.set()
        self._http.close()

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ core
    def request(self, method: str, path: str, *, json: Any = None, retry_not_found: bool = False,
                deadline_s: float | None = None) -> httpx.Response:
        """One call with retries until the deadline.

        Raises:
            PlanUnavailableError: when the deadline passes without a useful answer.
            PlanRequestError: on a 4xx answer that is not retried.
        """
        start = time.monotonic()
        deadline = start + (self.retry.deadline_s if deadline_s is None else deadline_s)
        backoff = self.retry.initial_backoff_s
        attempts = 0
        last = "no attempt"
        url = f"{self.base_url}{path}"
        while True:
            attempts += 1
            try:
                response = self._http.request(method, path, json=json)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                code = response.status_code
                if code < 400:
                    return response
                # A 404 is retried only when the service says the plan is coming (Retry-After:
                # a step still being planned); an unknown epoch or step fails at once.
                if code in _RETRY_STATUS or (code == 404 and retry_not_found
                                             and "retry-after" in response.headers):
                    last = f"HTTP {code}: {_detail(response)}"
                else:
                    raise PlanRequestError(f"{method} {url} -> HTTP {code}: {_detail(response)}")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                raise PlanUnavailableError(
                    f"{method} {url}: no answer within the {deadline - start:.1f} s deadline after "
                    f"{attempts} attempts ({time.monotonic() - start:.1f} s); last error: {last}")
            logger.debug("%s %s failed (%s); retrying", method, url, last)
            time.sleep(min(remaining, random.uniform(0, backoff)) + 1e-3)
            backoff = min(backoff * 2, self.retry.max_backoff_s)

    # ------------------------------------------------------------ routes
    def health(self) -> dict[str, Any]:
        """``GET /healthz``."""
        return dict(self.request("GET", "/healthz").json())

    def rank_plan(self, epoch_id: str, step: int, rank: int, *, deadline_s: float | None = None
                  ) -> RankPlan:
        """This rank's part of a stored step (waits while the step is not planned yet)."""
        response = self.request("GET", f"/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}",
                                retry_not_found=True, deadline_s=deadline_s)
        return RankPlan.model_validate_json(response.content)

    def step_plan(self, epoch_id: str, step: int) -> tuple[Plan, str]:
        """The whole plan of a stored step and its digest (checked against the plan).

        Raises:
            PlanUnavailableError: when the digest does not match the plan's content.
        """
        body = self.request("GET", f"/v1/epochs/{epoch_id}/steps/{step}", retry_not_found=True).json()
        plan = Plan.model_validate(body["plan"])
        if plan.digest() != body["digest"]:
            raise PlanUnavailableError(f"step {step} of {epoch_id!r}: served digest {body['digest']} "
                                       f"does not match the plan ({plan.digest()})")
        return plan, str(body["digest"])

    def start_epoch(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/epochs`` (see the service's ``EpochRequest``); returns the job status."""
        return dict(self.request("POST", "/v1/epochs", json=dict(body)).json())

    def epoch_status(self, epoch_id: str) -> dict[str, Any]:
        """``GET /v1/epochs/{id}``."""
        return dict(self.request("GET", f"/v1/epochs/{epoch_id}").json())

    def epoch_layouts(self, epoch_id: str) -> list[tuple[int, int, int]] | None:
        """The attention layouts ``(size, ulysses_degree, ring_degree)`` the epoch's plans may use
        (``EpochStatus.layouts``), for ``GroupRegistry.from_layouts``; ``None`` for an epoch stored
        before epochs declared them (its plans are pure Ulysses unless planned with rings)."""
        layouts = self.epoch_status(epoch_id).get("layouts")
        return None if layouts is None else [(int(d), int(u), int(r)) for d, u, r in layouts]

    def recalibration(self, epoch_id: str) -> dict[str, Any]:
        """``GET /v1/epochs/{id}/recalibration``: revisions, whether a fit is running, errors."""
        return dict(self.request("GET", f"/v1/epochs/{epoch_id}/recalibration").json())

    def wait_for_revision(self, epoch_id: str, *, timeout_s: float = 120.0, poll_s: float = 0.2) -> bool:
        """Wait until the epoch has a revision of its cost model and no fit is running (the steps
        nobody fetched are then re-planned); ``False`` when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.recalibration(epoch_id)
            if report["revisions"] and not report["busy"]:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)

    def plan_batch(self, body: Mapping[str, Any]) -> Plan:
        """``POST /v1/plans`` (samples, cluster, cost_model_id, options); returns the plan."""
        return Plan.model_validate(self.request("POST", "/v1/plans", json=dict(body)).json()["plan"])


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))[:300]
    except ValueError:
        return response.text[:300]


class PlanPrefetcher:
    """Serves one rank's plans by step, fetching the next ``depth`` steps in the background."""

    def __init__(self, client: PlannerClient, *, epoch_id: str, rank: int, depth: int = 4,
                 num_steps: int | None = None, fallback: Callable[[int], Plan] | None = None) -> None:
        """Bind to an epoch.

        Args:
            client: The service client (its retry policy applies to every fetch).
            epoch_id: The epoch job.
            rank: This rank.
            depth: Steps fetched ahead of the current one.
            num_steps: Steps in the epoch (no prefetch past the end), when known.
            fallback: ``step -> Plan`` planned locally with the same inputs as the service,
                used when the service stays unreachable past the deadline.
        """
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.client, self.epoch_id, self.rank = client, epoch_id, rank
        self.depth, self.num_steps, self.fallback = depth, num_steps, fallback
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dcp-prefetch-r{rank}")
        self._pending: dict[int, Future[RankPlan]] = {}
        self._done: OrderedDict[int, RankPlan] = OrderedDict()
        self.num_fallbacks = 0
        """Steps served by the local fallback."""

    def _fetch(self, step: int) -> RankPlan:
        return self.client.rank_plan(self.epoch_id, step, self.rank)

    def _schedule(self, step: int) -> None:
        for ahead in range(step + 1, step + 1 + self.depth):
            if self.num_steps is not None and ahead >= self.num_steps:
                break
            if ahead not in self._pending:
                self._pending[ahead] = self._pool.submit(self._fetch, ahead)
        for old in [s for s in self._pending if s < step]:
            self._pending.pop(old).cancel()

    def get(self, step: int) -> RankPlan:
        """This rank's plan of ``step`` (prefetched when possible; recent steps are kept, so a
        data loader and the training loop may both ask).

        Raises:
            PlanUnavailableError: when the service stays unreachable past the deadline and
                there is no fallback.
        """
        if step in self._done:
            return self._done[step]
        start = time.monotonic()
        future = self._pending.pop(step, None)
        self._schedule(step)
        plan: RankPlan | None = None
        if future is not None:
            try:
                plan = future.result(timeout=self.client.retry.deadline_s)
            except Exception as exc:  # a prefetch that failed is retried below, fresh
                logger.debug("rank %d: prefetch of step %d failed: %s", self.rank, step, exc)
        if plan is None:
            remaining = self.client.retry.deadline_s - (time.monotonic() - start)
            try:
                plan = self.client.rank_plan(self.epoch_id, step, self.rank,
                                             deadline_s=max(remaining, 1e-3))
            except PlanUnavailableError as exc:
                if self.fallback is None:
                    raise
                logger.warning("rank %d: planner unavailable for step %d (%s); planning locally",
                               self.rank, step, exc)
                self.num_fallbacks += 1
                plan = self.fallback(step).rank_view(self.rank)
        if plan.step is not None and plan.step != step:
            raise PlanUnavailableError(f"asked for step {step} of {self.epoch_id!r}, got step {plan.step}")
        self._done[step] = plan
        while len(self._done) > self.depth + 2:
            self._done.popitem(last=False)
        return plan

    def close(self) -> None:
        """Cancel pending prefetches."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
