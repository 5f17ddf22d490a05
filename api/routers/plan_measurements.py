"""Measured times of one-off plans, and recalibrating a cost model from them.

``POST /v1/plans/measurements`` takes a plan as ``POST /v1/plans`` returned it, the cluster it
ran on and what ranks measured (the digest checked: 409; the model unknown: 404; a rank outside
the world or a wrong micro-batch count: 422; stored whole or not at all).
``POST /v1/cost-models/{id}/recalibrate`` fits a revision ``id@rev`` from them on the solver
pool; ``cost_model_id: "id@rev"`` then plans with it (``POST /v1/plans``, ``POST /v1/epochs``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures.process import BrokenProcessPool
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, status
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.deps import ServiceState, State, Writer
from api.errors import COMMON_RESPONSES, conflict, not_found, service_unavailable, unprocessable
from api.measurements_store import RankMeasurement
from api.plan_measurements import base_id
from api.pool import DeadlineExceededError
from api.registry import check_compatible, resolve_cluster
from api.routers.measurements import (
    LIMITER,
    MAX_MEASURED_S,
    MAX_MICRO_BATCHES,
    POSTS_PER_S,
    RevisionOut,
    recalibrator_of,
)
from api.schemas import MAX_NUM_GPUS, ClusterField, as_cluster
from api.strictjson import StrictJSONRoute
from planner.plan import Plan

router = APIRouter(tags=["measurements"], route_class=StrictJSONRoute, responses=COMMON_RESPONSES)


class RankTimesIn(BaseModel):
    """What one rank measured running the plan."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(strict=True, ge=0, lt=MAX_NUM_GPUS, description="The rank that measured.")
    plan_digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="Digest of the plan that ran.")
    micro_batch_times_s: list[Annotated[float, Field(gt=0, le=MAX_MEASURED_S)]] = Field(
        min_length=1, max_length=MAX_MICRO_BATCHES,
        description="Forward+backward seconds of each of the group's micro-batches, in plan order.")
    peak_bytes: int | None = Field(default=None, strict=True, ge=0, le=2**62,
                                   description="Peak allocated bytes (None: not measured).")


class PlanMeasurementsRequest(BaseModel):
    """A one-off plan and what its ranks measured."""

    model_config = ConfigDict(extra="forbid")

    plan: dict[str, Any] = Field(description="The plan as POST /v1/plans returned it.")
    cluster: ClusterField
    ranks: list[RankTimesIn] = Field(min_length=1, max_length=MAX_NUM_GPUS)


class PlanMeasurementsAccepted(BaseModel):
    """What the service stored."""

    digest: str = Field(description="The plan's digest.")
    stored: int = Field(description="Rank measurements stored.")
    duplicates: int = Field(description="Ranks that had already reported this plan (ignored).")


def _plan(body: PlanMeasurementsRequest) -> Plan:
    num_ranks = body.plan.get("num_ranks")
    if not isinstance(num_ranks, int) or not 0 < num_ranks <= MAX_NUM_GPUS:
        unprocessable(["body", "plan", "num_ranks"], f"num_ranks must be an integer in 1..{MAX_NUM_GPUS}")
    try:
        return Plan.model_validate(body.plan)
    except ValidationError as exc:
        first = exc.errors()[0]
        unprocessable(["body", "plan", *first.get("loc", ())], str(first.get("msg", "invalid plan")))


def _checked(state: ServiceState, body: PlanMeasurementsRequest) -> tuple[Plan, str, Any, list[RankMeasurement]]:
    plan = _plan(body)
    digest = plan.digest()
    try:
        model = state.registry.get(base_id(plan.cost_model_id))
    except KeyError as exc:
        not_found(f"the plan's cost model: {exc.args[0]}")
    try:
        cluster = resolve_cluster(as_cluster(body.cluster))
        check_compatible(model, cluster)
    except ValueError as exc:
        unprocessable(["body", "cluster"], str(exc))
    if cluster.num_gpus != plan.num_ranks:
        unprocessable(["body", "cluster"], f"cluster {cluster.name!r} has {cluster.num_gpus} GPUs, the plan "
                      f"{plan.num_ranks} ranks")
    rows = []
    for i, item in enumerate(body.ranks):
        if item.plan_digest != digest:
            conflict(f"ranks[{i}]: plan_digest {item.plan_digest[:16]}... is not the digest of this plan "
                     f"({digest[:16]}...)")
        if item.rank >= plan.num_ranks:
            unprocessable(["body", "ranks", i, "rank"], f"rank {item.rank} is not in the plan's world of "
                          f"{plan.num_ranks}")
        group = plan.group_of_rank(item.rank)
        if len(item.micro_batch_times_s) != len(group.micro_batches):
            unprocessable(["body", "ranks", i, "micro_batch_times_s"],
                          f"{len(item.micro_batch_times_s)} times for the {len(group.micro_batches)} "
                          f"micro-batches of rank {item.rank}'s group")
        rows.append(RankMeasurement(step=plan.step or 0, rank=item.rank, first_rank=group.first_rank,
                                    group_size=group.size, digest=digest,
                                    times_s=tuple(item.micro_batch_times_s), peak_bytes=item.peak_bytes))
    return plan, digest, cluster, rows


@router.post("/v1/plans/measurements", response_model=PlanMeasurementsAccepted, dependencies=[Writer],
             responses={404: {"description": "The plan's cost model is unknown."},
                        409: {"description": "A digest that is not the plan's."},
                        422: {"description": "An invalid plan or cluster, a rank outside the world, a "
                                             "wrong micro-batch count."},
                        429: {"description": "Too many posts from one rank (Retry-After)."}})
async def post_plan_measurements(body: PlanMeasurementsRequest, state: State) -> PlanMeasurementsAccepted:
    """Store what ranks measured running a one-off plan (all ranks or none; a rank that already
    reported the plan is ignored)."""
    recalibrator = recalibrator_of(state)

    def store() -> PlanMeasurementsAccepted:
        plan, digest, cluster, rows = _checked(state, body)
        if not LIMITER.allow((f"plan:{digest}", rows[0].rank)):
            raise HTTPException(status_code=status.HTTP_429_TOO_MANY_REQUESTS,
                                detail=f"more than {POSTS_PER_S:g} measurement posts per second from rank "
                                       f"{rows[0].rank}", headers={"Retry-After": "1"})
        stored, duplicates = recalibrator.plan_measurements.add(plan, digest=digest, cluster=cluster, rows=rows)
        return PlanMeasurementsAccepted(digest=digest, stored=stored, duplicates=duplicates)

    return await asyncio.to_thread(store)


@router.post("/v1/cost-models/{cost_model_id}/recalibrate", response_model=RevisionOut,
             status_code=status.HTTP_201_CREATED, dependencies=[Writer], tags=["cost-models"],
             responses={404: {"description": "Unknown cost model."},
                        422: {"description": "No measured one-off plan of this cost model."}})
async def recalibrate_cost_model(
        cost_model_id: Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$",
                                           description="Cost-model id (without @rev).")],
        state: State) -> RevisionOut:
    """Fit a new revision ``id@rev`` from the measured one-off plans of the model (the newest 256),
    on the solver pool; every 5th plan is held out for its fit quality."""
    recalibrator = recalibrator_of(state)
    try:
        await asyncio.to_thread(state.registry.get, cost_model_id)
    except KeyError as exc:
        not_found(str(exc.args[0]))
    try:
        revision = await asyncio.to_thread(recalibrator.recalibrate_plans, cost_model_id)
    except (DeadlineExceededError, BrokenProcessPool):
        service_unavailable("solver pool unavailable or past its deadline; retry")
    except ValueError as exc:
        unprocessable(["path", "cost_model_id"], str(exc))
    if revision is None:
        unprocessable(["path", "cost_model_id"], f"no measured one-off plan of cost model {cost_model_id!r}: "
                      "POST /v1/plans/measurements first")
    return RevisionOut(ref=revision.ref, rev=revision.rev, scales=revision.scales, fit=revision.fit,
                       source_epoch=revision.source_epoch, created_at=revision.created_at)
