"""Measured step times in, recalibration settings and reports out.

``POST /v1/epochs/{epoch_id}/measurements`` takes what ranks measured per step (each step
checked against the stored plan: unknown step 404, another plan's digest 409, a rank outside
the world or a wrong micro-batch count 422; nothing is stored unless every step passes) and
may start a recalibration (``api.recalibration``, never in the request). The recalibration
routes set an epoch's settings and report the prediction error per step and per revision;
the revision routes list the immutable cost-model revisions.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status
from pydantic import BaseModel, ConfigDict, Field

from api.deps import ServiceState, State, Writer
from api.errors import COMMON_RESPONSES, conflict, not_found, unprocessable
from api.measurements_store import RankMeasurement
from api.recalibration import Recalibrator
from api.revisions_store import split_ref
from api.routers.epochs import MAX_STEP, EpochId
from api.schemas import MAX_NUM_GPUS
from api.strictjson import StrictJSONRoute
from costmodel.schema import CostModelFile

router = APIRouter(tags=["measurements"], route_class=StrictJSONRoute, responses=COMMON_RESPONSES)

MAX_STEPS_PER_POST = 256
"""Most steps one measurement post carries."""
MAX_MICRO_BATCHES = 4096
"""Most micro-batches of one group in one step."""
MAX_MEASURED_S = 86400.0
"""Longest micro-batch time accepted (a day)."""
MAX_REPORT_STEPS = 512
"""The recalibration report covers the most recent measured steps."""
POSTS_PER_S = 20.0
"""Sustained measurement posts per second per epoch and rank (burst: twice as many)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepMeasurementIn(_Strict):
    """One rank's measurements of one step."""

    step: int = Field(strict=True, ge=0, le=MAX_STEP, description="Step index in the epoch.")
    rank: int = Field(strict=True, ge=0, lt=MAX_NUM_GPUS, description="The rank that measured.")
    plan_digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="Digest of the plan that ran.")
    micro_batch_times_s: list[Annotated[float, Field(gt=0, le=MAX_MEASURED_S)]] = Field(
        min_length=1, max_length=MAX_MICRO_BATCHES,
        description="Forward+backward seconds of each of the group's micro-batches, in plan order.")
    peak_bytes: int | None = Field(default=None, strict=True, ge=0, le=2**62,
                                   description="Peak allocated bytes of the step (None: not measured).")


class MeasurementsRequest(_Strict):
    """A batch of step measurements (usually one rank's last few steps)."""

    steps: list[StepMeasurementIn] = Field(min_length=1, max_length=MAX_STEPS_PER_POST)


class MeasurementsAccepted(BaseModel):
    """What the service did with a post."""

    stored: int = Field(description="Step measurements stored.")
    duplicates: int = Field(description="Steps this rank had already reported (ignored).")
    recalibration: str = Field(description="off, not due, scheduled or running.")


class RecalibrationSettings(_Strict):
    """How an epoch recalibrates."""

    follow: bool = Field(strict=True, description="Re-plan the steps no rank fetched yet with each "
                                                  "new cost-model revision.")
    every_steps: int = Field(strict=True, ge=0, le=1_000_000,
                             description="Recalibrate after this many newly measured steps (0: never).")


class RevisionOut(BaseModel):
    """One immutable cost-model revision."""

    ref: str = Field(description="id@rev.")
    rev: int = Field(description="Revision number (>= 1; 0 is the original file).")
    scales: dict[str, float] = Field(description="Factor per term applied to the original file: the time "
                                                 "terms and `activation`, the factor on the bytes per token.")
    fit: dict[str, Any] = Field(description="Fit quality: held-out and training MAPE before/after; `memory`: the "
                                            "bytes factor's fit on measured step peaks (null without peaks).")
    source_epoch: str | None = Field(description="Epoch whose measurements it was fitted on.")
    created_at: float = Field(description="Unix time.")


class StepError(BaseModel):
    """The plan's predictions against what ranks measured, for one step."""

    step: int = Field(description="Step index.")
    rev: int = Field(description="Cost-model revision the plan was made with.")
    num_micro_batches: int = Field(description="Measured micro-batches (one per group and micro-batch).")
    mape: float = Field(description="Mean |predicted - measured| / measured.")
    mean_ratio: float = Field(description="Mean predicted / measured.")
    mean_abs_log_ratio: float = Field(description="Mean |ln(predicted / measured)| (0: exact; symmetric "
                                                  "in over- and under-prediction, unlike the MAPE).")


class RevisionError(BaseModel):
    """Prediction error of the steps planned with one revision."""

    rev: int = Field(description="Revision (0: the original file).")
    num_steps: int = Field(description="Measured steps planned with it.")
    mape: float = Field(description="MAPE over their micro-batches.")
    mean_abs_log_ratio: float = Field(description="Mean |ln(predicted / measured)| over them.")


class RecalibrationReport(BaseModel):
    """An epoch's recalibration: settings, revisions, and prediction error before/after."""

    epoch_id: str
    cost_model_id: str = Field(description="The epoch's original cost model.")
    follow: bool
    every_steps: int
    frozen_through: int = Field(description="Steps up to this one were fetched and never change.")
    current_ref: str = Field(description="Revision the newest plans use (id or id@rev).")
    busy: bool = Field(description="A recalibration is running.")
    measured_steps: int
    revisions: list[RevisionOut]
    by_revision: list[RevisionError]
    steps: list[StepError]


def recalibrator_of(state: ServiceState) -> Recalibrator:
    """The service's recalibrator, or a 503 while it is not running."""
    found = state.recalibrator
    if found is None:
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                            detail="recalibration is not running", headers={"Retry-After": "1"})
    return found


class RateLimiter:
    """Token buckets per (epoch or plan, rank)."""

    def __init__(self, rate_per_s: float, burst: float) -> None:
        self.rate_per_s, self.burst = rate_per_s, burst
        self._buckets: dict[tuple[str, int], tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: tuple[str, int]) -> bool:
        """Take a token for ``key``; False when its bucket is empty."""
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate_per_s)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                return False
            self._buckets[key] = (tokens - 1.0, now)
            if len(self._buckets) > 100_000:
                self._buckets.clear()
            return True


LIMITER = RateLimiter(POSTS_PER_S, 2 * POSTS_PER_S)


def _checked(state: ServiceState, epoch_id: str, body: MeasurementsRequest) -> list[RankMeasurement]:
    record = state.store.get_epoch(epoch_id)
    if record is None:
        not_found(f"unknown epoch {epoch_id!r}")
    rows = []
    for i, item in enumerate(body.steps):
        if item.step >= record.steps_total:
            not_found(f"steps[{i}]: epoch {epoch_id!r} has {record.steps_total} steps; step {item.step} "
                      "does not exist")
        try:
            view = state.store.get_rank_view(epoch_id, item.step, item.rank)
        except ValueError as exc:
            unprocessable(["body", "steps", i, "rank"], str(exc))
        if view is None:
            not_found(f"steps[{i}]: step {item.step} of epoch {epoch_id!r} is not planned: nothing ran it")
        data = json.loads(view)
        if data["plan_digest"] != item.plan_digest:
            conflict(f"steps[{i}]: plan_digest {item.plan_digest[:16]}... is not the digest of step "
                     f"{item.step} of epoch {epoch_id!r} ({data['plan_digest'][:16]}...): a plan of "
                     "another step or epoch")
        group = data["group"]
        expected = len(group["micro_batches"])
        if len(item.micro_batch_times_s) != expected:
            unprocessable(["body", "steps", i, "micro_batch_times_s"],
                          f"{len(item.micro_batch_times_s)} times for the {expected} micro-batches of "
                          f"rank {item.rank}'s group in step {item.step}")
        rows.append(RankMeasurement(step=item.step, rank=item.rank, first_rank=group["ranks"][0],
                                    group_size=len(group["ranks"]), digest=item.plan_digest,
                                    times_s=tuple(item.micro_batch_times_s), peak_bytes=item.peak_bytes))
    return rows


@router.post("/v1/epochs/{epoch_id}/measurements", response_model=MeasurementsAccepted,
             dependencies=[Writer],
             responses={404: {"description": "Unknown epoch, or a step that does not exist or is not "
                                             "planned."},
                        409: {"description": "A plan digest that is not the step's."},
                        422: {"description": "Invalid times, a rank outside the step's world, or a "
                                             "micro-batch count that is not the plan's."},
                        429: {"description": "Too many posts from one rank (Retry-After)."}})
async def post_measurements(epoch_id: EpochId, body: MeasurementsRequest, state: State
                            ) -> MeasurementsAccepted:
    """Store measured forward+backward times per micro-batch (and peak bytes) of planned steps;
    all steps or none. A step a rank already reported is ignored (posts may be retried)."""
    recalibrator = recalibrator_of(state)
    if not LIMITER.allow((epoch_id, body.steps[0].rank)):
        raise HTTPException(status_code=status.HTTP_429_TOO_MANY_REQUESTS,
                            detail=f"more than {POSTS_PER_S:g} measurement posts per second from rank "
                                   f"{body.steps[0].rank}; batch steps into fewer posts",
                            headers={"Retry-After": "1"})

    def store() -> MeasurementsAccepted:
        rows = _checked(state, epoch_id, body)
        stored, duplicates = recalibrator.measurements.add(epoch_id, rows)
        return MeasurementsAccepted(stored=stored, duplicates=duplicates,
                                    recalibration=recalibrator.maybe_start(epoch_id))

    return await asyncio.to_thread(store)


def _report(state: ServiceState, recalibrator: Recalibrator, epoch_id: str) -> RecalibrationReport:
    from api.recalibration import observations, recent
    from planner.plan import Plan

    record = state.store.get_epoch(epoch_id)
    if record is None:
        not_found(f"unknown epoch {epoch_id!r}")
    cost_model_id, start_rev = split_ref(record.spec["cost_model_id"])
    settings = recalibrator.revisions.state(epoch_id)
    groups = recent(recalibrator.measurements.groups(epoch_id), MAX_REPORT_STEPS)
    plans = {}
    for step in sorted({g.step for g in groups}):
        row = state.store.get_plan(epoch_id, step)
        if row is not None:
            plans[step] = Plan.model_validate_json(row[1])
    step_revs = recalibrator.revisions.step_revisions(epoch_id)
    per_step: dict[int, list[tuple[float, float]]] = {}
    for r in observations(groups, plans):
        per_step.setdefault(r["step"], []).append((r["predicted_s"], r["measured_s"]))
    steps = [StepError(step=s, rev=step_revs.get(s, start_rev), num_micro_batches=len(pairs),
                       mape=sum(abs(p - m) / m for p, m in pairs) / len(pairs),
                       mean_ratio=sum(p / m for p, m in pairs) / len(pairs),
                       mean_abs_log_ratio=sum(abs(math.log(max(p, 1e-300) / m)) for p, m in pairs) / len(pairs))
             for s, pairs in sorted(per_step.items())]
    by_rev: dict[int, list[StepError]] = {}
    for e in steps:
        by_rev.setdefault(e.rev, []).append(e)
    by_revision = []
    for rev, errs in sorted(by_rev.items()):
        count = sum(e.num_micro_batches for e in errs)
        by_revision.append(RevisionError(
            rev=rev, num_steps=len(errs), mape=sum(e.mape * e.num_micro_batches for e in errs) / count,
            mean_abs_log_ratio=sum(e.mean_abs_log_ratio * e.num_micro_batches for e in errs) / count))
    revisions = [RevisionOut(ref=r.ref, rev=r.rev, scales=r.scales, fit=r.fit, source_epoch=r.source_epoch,
                             created_at=r.created_at) for r in recalibrator.revisions.revisions(cost_model_id)]
    current = settings.current_rev or start_rev
    return RecalibrationReport(
        epoch_id=epoch_id, cost_model_id=cost_model_id, follow=settings.follow,
        every_steps=settings.every_steps, frozen_through=settings.frozen_through,
        current_ref=cost_model_id if current == 0 else f"{cost_model_id}@{current}",
        busy=recalibrator.busy(epoch_id), measured_steps=recalibrator.measurements.measured_steps(epoch_id),
        revisions=revisions, by_revision=by_revision, steps=steps)


@router.get("/v1/epochs/{epoch_id}/recalibration", response_model=RecalibrationReport,
            responses={404: {"description": "Unknown epoch."}})
async def get_recalibration(epoch_id: EpochId, state: State) -> RecalibrationReport:
    """Settings, revisions, and the prediction error of the last 512 measured steps (with the
    revision each plan was made with) and per revision: the error before and after recalibration."""
    recalibrator = recalibrator_of(state)
    return await asyncio.to_thread(_report, state, recalibrator, epoch_id)


@router.post("/v1/epochs/{epoch_id}/recalibration", response_model=RecalibrationReport,
             dependencies=[Writer], responses={404: {"description": "Unknown epoch."}})
async def set_recalibration(epoch_id: EpochId, body: RecalibrationSettings, state: State
                            ) -> RecalibrationReport:
    """Recalibrate the epoch's cost model every ``every_steps`` measured steps; with ``follow``,
    re-plan the steps no rank has fetched with each new revision (fetched steps never change)."""
    recalibrator = recalibrator_of(state)

    def configure() -> RecalibrationReport:
        if state.store.get_epoch(epoch_id) is None:
            not_found(f"unknown epoch {epoch_id!r}")
        recalibrator.revisions.configure(epoch_id, follow=body.follow, every_steps=body.every_steps)
        recalibrator.maybe_start(epoch_id)
        return _report(state, recalibrator, epoch_id)

    return await asyncio.to_thread(configure)


CostModelId = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$",
                                  description="Cost-model id (without @rev).")]


@router.get("/v1/cost-models/{cost_model_id}/revisions", response_model=list[RevisionOut],
            tags=["cost-models"])
async def list_revisions(cost_model_id: CostModelId, state: State) -> list[RevisionOut]:
    """The recalibrated revisions of a cost model, oldest first (empty when none)."""
    recalibrator = recalibrator_of(state)
    found = await asyncio.to_thread(recalibrator.revisions.revisions, cost_model_id)
    return [RevisionOut(ref=r.ref, rev=r.rev, scales=r.scales, fit=r.fit, source_epoch=r.source_epoch,
                        created_at=r.created_at) for r in found]


@router.get("/v1/cost-models/{cost_model_id}/revisions/{rev}", response_model=CostModelFile,
            tags=["cost-models"], responses={404: {"description": "Unknown revision."}})
async def get_revision(cost_model_id: CostModelId,
                       rev: Annotated[int, Path(ge=1, le=10**9, description="Revision number.")],
                       state: State) -> CostModelFile:
    """The coefficients of revision ``rev`` (its ``id`` is ``cost_model_id@rev``)."""
    recalibrator = recalibrator_of(state)
    found = await asyncio.to_thread(recalibrator.revisions.revisions, cost_model_id)
    for r in found:
        if r.rev == rev:
            return r.file
    not_found(f"cost model {cost_model_id!r} has no revision {rev} ({len(found)} revisions)")
