"""``/v1/epochs``: epoch precompute jobs and their stored plans (whole, per rank, ranges)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status

from api.deps import ServiceState, State, Writer
from api.errors import COMMON_RESPONSES, bad_request, conflict, not_found, unprocessable
from api.jobs import prepare_epoch
from api.manifests import PathEscapeError, load_manifest, resolve_manifest_path
from api.schemas import (
    EPOCH_ID_PATTERN,
    MAX_NUM_GPUS,
    EpochRequest,
    EpochStatus,
    EpochSummary,
    StepPlan,
    as_cluster,
)
from api.store import ACTIVE_STATES, EpochExistsError, EpochRecord
from api.strictjson import StrictJSONRoute
from costmodel.model_choice import check_samples_kind
from costmodel.specs import Sample
from planner.epoch import BatchRule
from planner.plan import RankPlan

router = APIRouter(prefix="/v1/epochs", tags=["epochs"], route_class=StrictJSONRoute,
                   responses=COMMON_RESPONSES)

MAX_RANGE_STEPS = 256
"""Most steps one range request returns."""

EpochId = Annotated[str, Path(pattern=EPOCH_ID_PATTERN, description="Epoch id.")]
MAX_STEP = 2**31 - 1
"""Largest step index a path or query may name."""

StepIndex = Annotated[int, Path(ge=0, le=MAX_STEP, description="Step index in the epoch.")]


def _status(state: ServiceState, record: EpochRecord) -> EpochStatus:
    """The status of a job (reads the store: call it on a worker thread)."""
    summary = state.store.summary(record.id)
    spec = record.spec
    job_state, error, transient, attempts = record.state, record.error, record.transient, record.attempts
    fault = state.jobs.live_fault(record.id) if record.state in ACTIVE_STATES else None
    if fault is not None:  # what the store may be unable to record (it is the fault, or is locked)
        job_state, error, transient = "queued", fault.cause, True
        attempts = max(attempts, fault.attempts)
    return EpochStatus(
        epoch_id=record.id, state=job_state,  # type: ignore[arg-type]
        steps_total=record.steps_total, steps_done=record.steps_done,
        progress=record.steps_done / max(record.steps_total, 1), eta_s=state.jobs.eta_s(record),
        steps_per_s=state.jobs.steps_per_s(record),
        cluster_name=spec["cluster"]["name"], cost_model_id=spec["cost_model_id"], seed=spec["seed"],
        batch=spec["batch"], created_at=record.created_at, started_at=record.started_at,
        finished_at=record.finished_at, error=error, transient=transient, attempts=attempts,
        retry_in_s=None if fault is None else round(fault.retry_in_s, 3),
        layouts=None if spec.get("layouts") is None else [tuple(t) for t in spec["layouts"]],
        summary=EpochSummary(mean_predicted_speedup_vs_strongest=summary["mean_speedup_vs_strongest"],
                             mean_predicted_speedup_vs_bucket=summary["mean_speedup_vs_bucket"],
                             mean_gap=summary["mean_gap"],
                             mean_predicted_step_time_s=summary["mean_predicted_step_time_s"],
                             steps_vs_strongest=int(summary["steps_vs_strongest"] or 0),
                             steps_vs_bucket=int(summary["steps_vs_bucket"] or 0)))


def _record(state: ServiceState, epoch_id: str) -> EpochRecord:
    """The stored job, or a 404 (reads the store: call it on a worker thread)."""
    record = state.store.get_epoch(epoch_id)
    if record is None:
        not_found(f"unknown epoch {epoch_id!r}")
    return record


def _missing_step(record: EpochRecord, step: int) -> Response:
    if step >= record.steps_total:
        not_found(f"epoch {record.id!r} has {record.steps_total} steps; step {step} does not exist")
    not_found(f"step {step} of epoch {record.id!r} is not planned yet ({record.steps_done}/"
              f"{record.steps_total} done, job {record.state})"
              + ("; retry later" if record.state in ACTIVE_STATES else ""),
              retry_after_s=1 if record.state in ACTIVE_STATES else None)


@router.post("", status_code=status.HTTP_202_ACCEPTED, response_model=EpochStatus, dependencies=[Writer],
             responses={400: {"description": "manifest_path outside the data directory."},
                        404: {"description": "Unknown cost model."},
                        409: {"description": "epoch_id already exists."},
                        422: {"description": "Invalid manifest, batch rule, cluster or options."}})
async def create_epoch(body: EpochRequest, state: State) -> EpochStatus:
    """Start an epoch precompute job: the manifest is shuffled with the seed and cut into
    steps by the batch rule now; each step is then planned on the process pool and stored."""
    epoch_id = body.epoch_id or f"epoch-{uuid.uuid4().hex[:12]}"
    if await asyncio.to_thread(state.store.get_epoch, epoch_id) is not None:
        conflict(f"epoch {epoch_id!r} already exists")
    cluster, cost_model = await asyncio.to_thread(state.planning_inputs, cluster=as_cluster(body.cluster),
                                                  cost_model_id=body.cost_model_id, model=body.model,
                                                  model_config=body.model_config_json,
                                                  loss_chunk_tokens=body.loss_chunk_tokens)
    model_source = {"cost_model_id": None, "model": f"model {body.model}",
                    "model_config": f"model_config ({cost_model.model.name})"}[body.model_field]
    path = None
    if body.manifest_path is not None:
        try:
            path = resolve_manifest_path(state.settings.data_dir, body.manifest_path)
        except PathEscapeError as exc:
            bad_request(str(exc))
        except ValueError as exc:
            unprocessable(["body", "manifest_path"], str(exc))
    options = body.options.to_options(default_time_limit_s=state.settings.plan_time_limit_s,
                                      default_layout=state.settings.plan_layout)
    rule = BatchRule(samples_per_step=body.batch.samples_per_step,
                     tokens_per_step=body.batch.tokens_per_step)

    field = "manifest_jsonl" if body.manifest_jsonl is not None else "manifest_path"

    def prepare() -> EpochStatus:
        try:
            samples: list[Sample] = load_manifest(text=body.manifest_jsonl, path=path,
                                                  max_samples=state.settings.max_manifest_samples)
        except ValueError as exc:
            unprocessable(["body", field], str(exc))
        try:  # before anything is stored: a manifest of the other kind than the model
            check_samples_kind(samples, cost_model.model, source=field)
        except ValueError as exc:
            unprocessable(["body", field], str(exc))
        longest = max((s.tokens for s in samples), default=0)
        if body.loss_chunk_tokens is not None and body.loss_chunk_tokens > longest:
            unprocessable(["body", "loss_chunk_tokens"],
                          f"loss_chunk_tokens={body.loss_chunk_tokens} is larger than the manifest's longest "
                          f"sample ({longest} tokens): give at most that many tokens, or 0 for whole logits")
        record = prepare_epoch(state.store, epoch_id=epoch_id, samples=samples, rule=rule,
                               seed=body.seed, cluster=cluster, cost_model=cost_model,
                               options=options, manifest_source=body.manifest_path or "inline",
                               model_source=model_source)
        state.jobs.start(record.id)
        return _status(state, record)

    try:
        return await asyncio.to_thread(prepare)
    except EpochExistsError as exc:
        conflict(str(exc))
    except ValueError as exc:
        unprocessable(["body"], str(exc))


@router.get("", response_model=list[EpochStatus])
async def list_epochs(state: State) -> list[EpochStatus]:
    """Every epoch job, oldest first."""
    return await asyncio.to_thread(lambda: [_status(state, r) for r in state.store.list_epochs()])


@router.get("/{epoch_id}", response_model=EpochStatus, responses={404: {"description": "Unknown epoch."}})
async def get_epoch(epoch_id: EpochId, state: State) -> EpochStatus:
    """Status of a job: state, progress, ETA, summary of predicted speedup and gap."""
    return await asyncio.to_thread(lambda: _status(state, _record(state, epoch_id)))


@router.post("/{epoch_id}/cancel", response_model=EpochStatus, dependencies=[Writer],
             responses={404: {"description": "Unknown epoch."}})
async def cancel_epoch(epoch_id: EpochId, state: State) -> EpochStatus:
    """Cancel a queued or running job; the steps already stored stay served."""

    def cancel() -> EpochStatus:
        _record(state, epoch_id)
        return _status(state, state.jobs.cancel(epoch_id))

    return await asyncio.to_thread(cancel)


@router.post("/{epoch_id}/resume", response_model=EpochStatus, dependencies=[Writer],
             responses={404: {"description": "Unknown epoch."}})
async def resume_epoch(epoch_id: EpochId, state: State) -> EpochStatus:
    """Resume a failed or cancelled job: its stored steps are kept and only the missing ones
    are planned (a running job is left running, a job waiting to retry retries now, a done job
    is left done). The same plans as an uninterrupted run."""

    def resume() -> EpochStatus:
        _record(state, epoch_id)
        return _status(state, state.jobs.resume(epoch_id))

    return await asyncio.to_thread(resume)


@router.get("/{epoch_id}/steps", response_model=list[StepPlan],
            responses={404: {"description": "Unknown epoch."}})
async def get_steps(epoch_id: EpochId, state: State,
                    start: Annotated[int, Query(ge=0, le=MAX_STEP, description="First step.")] = 0,
                    stop: Annotated[int | None, Query(ge=0, le=MAX_STEP, description="One past the last "
                                                      "step (default start + 16).")] = None) -> Response:
    """The stored plans of steps ``[start, stop)`` (at most 256; steps not planned yet are absent)."""
    record = await asyncio.to_thread(_record, state, epoch_id)
    end = start + 16 if stop is None else stop
    if end < start:
        unprocessable(["query", "stop"], f"stop={end} is before start={start}")
    if end - start > MAX_RANGE_STEPS:
        unprocessable(["query", "stop"], f"a range holds at most {MAX_RANGE_STEPS} steps, got {end - start}")
    # Up to 256 whole plans: read off the event loop.
    rows = await asyncio.to_thread(state.store.get_plans, record.id, start=start, stop=end)
    body = "[" + ",".join(f'{{"step":{s},"digest":"{d}","plan":{p}}}' for s, d, p in rows) + "]"
    return Response(content=body, media_type="application/json")


@router.get("/{epoch_id}/steps/{step}", response_model=StepPlan,
            responses={404: {"description": "Unknown epoch, or step not planned yet (retry)."}})
async def get_step(epoch_id: EpochId, step: StepIndex, state: State) -> Response:
    """The whole plan of one step with its digest."""

    def read() -> Response:
        found = state.store.get_plan(epoch_id, step)
        if found is None:
            return _missing_step(_record(state, epoch_id), step)
        digest, plan_json = found
        return Response(content=f'{{"step":{step},"digest":"{digest}","plan":{plan_json}}}',
                        media_type="application/json")

    return await asyncio.to_thread(read)


@router.get("/{epoch_id}/steps/{step}/ranks/{rank}", response_model=RankPlan,
            responses={404: {"description": "Unknown epoch, rank outside the world, or step not "
                                            "planned yet (retry)."}})
async def get_rank_step(epoch_id: EpochId, step: StepIndex,
                        rank: Annotated[int, Path(ge=0, lt=MAX_NUM_GPUS, description="Global rank.")],
                        state: State, request: Request) -> Response:
    """Rank ``rank``'s part of one step (its group and micro-batches) with the plan digest. The
    first fetch of a step freezes it (never re-planned by recalibration afterwards); with an auth
    token set, only a fetch that carries the token freezes."""
    freeze = state.settings.tokens.can_read(request.headers.get("authorization"))

    def read() -> Response:
        # The first fetch of a step freezes it (api.revisions_store): never re-planned afterwards.
        try:
            if state.recalibrator is None:
                view = state.store.get_rank_view(epoch_id, step, rank)
            else:
                view = state.recalibrator.revisions.fetch_rank_view(epoch_id, step, rank, freeze=freeze)
        except ValueError as exc:
            not_found(str(exc))
        if view is None:
            return _missing_step(_record(state, epoch_id), step)
        return Response(content=view, media_type="application/json")

    return await asyncio.to_thread(read)
