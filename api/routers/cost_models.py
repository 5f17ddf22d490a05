"""``/v1/cost-models``: the embedded analytic defaults plus uploaded (fitted) cost models."""

from __future__ import annotations

import asyncio
from concurrent.futures.process import BrokenProcessPool
from typing import Annotated

from fastapi import APIRouter, Body, Path, Response, status

from api.cost_model_store import CostModelConflictError, InvalidStoredCostModelError
from api.deps import ServiceState, State, Writer
from api.errors import COMMON_RESPONSES, conflict, not_found, service_unavailable, unprocessable
from api.fitting import fit_profile_texts
from api.pool import DeadlineExceededError
from api.registry import CostModelInUseError
from api.schemas import CostModelCreated, CostModelInfo, FitRequest
from api.strictjson import StrictJSONRoute
from costmodel.presets import default_cost_model_file
from costmodel.schema import CostModelFile

router = APIRouter(prefix="/v1/cost-models", tags=["cost-models"], route_class=StrictJSONRoute,
                   responses=COMMON_RESPONSES)

FIT_DEADLINE_S = 300.0
"""Longest a fit may run on the pool."""

_UPLOAD_EXAMPLES = {"fitted": {
    "summary": "A fitted llama-7b model (here: the analytic default's coefficients, new id)",
    "value": default_cost_model_file("llama-7b", "h200-sxm").model_copy(
        update={"id": "fitted-llama-7b-h200-run1", "provenance": "fitted"}).model_dump(mode="json"),
}}

CostModelId = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$",
                                  description="Cost-model id.")]


@router.get("", response_model=list[CostModelInfo])
async def list_cost_models(state: State) -> list[CostModelInfo]:
    """Every cost model with its provenance (analytic or fitted) and source (builtin or uploaded);
    a stored model that no longer validates is left out (and logged)."""
    items = await asyncio.to_thread(state.registry.list)
    return [CostModelInfo(id=f.id, provenance=f.provenance, source=source,  # type: ignore[arg-type]
                          model=f.model.name, hardware=f.hardware, digest=f.digest(), notes=f.notes)
            for f, source in items]


@router.get("/{cost_model_id}", response_model=CostModelFile,
            responses={404: {"description": "Unknown cost model."},
                       409: {"description": "The stored file no longer validates (delete it)."}})
async def get_cost_model(cost_model_id: CostModelId, state: State) -> CostModelFile:
    """The full cost-model file."""
    try:
        return await asyncio.to_thread(state.registry.get, cost_model_id)
    except KeyError as exc:
        not_found(str(exc.args[0]))
    except InvalidStoredCostModelError as exc:
        conflict(str(exc))


@router.delete("/{cost_model_id}", status_code=status.HTTP_204_NO_CONTENT, dependencies=[Writer],
               responses={404: {"description": "No uploaded cost model has this id."},
                          409: {"description": "An embedded default, or used by an active epoch job."}})
async def delete_cost_model(cost_model_id: CostModelId, state: State) -> Response:
    """Delete an uploaded cost model (also one stored by an older version that no longer
    validates). Embedded defaults and models used by queued or running jobs stay."""
    try:
        deleted = await asyncio.to_thread(state.registry.delete, cost_model_id)
    except (CostModelConflictError, CostModelInUseError) as exc:
        conflict(str(exc))
    if not deleted:
        not_found(f"no uploaded cost model {cost_model_id!r}")
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _register(state: ServiceState, file: CostModelFile, response: Response) -> bool:
    """Add ``file`` to the registry; 409 on an id taken by another model, 200 (not 201) when the
    identical file was already there. Returns whether it was newly added."""
    try:
        created = state.registry.add(file)  # on a worker thread (see the callers)
    except CostModelConflictError as exc:
        conflict(str(exc))
    if not created:
        response.status_code = status.HTTP_200_OK
    return created


@router.post("", response_model=CostModelCreated, status_code=status.HTTP_201_CREATED,
             dependencies=[Writer],
             responses={200: {"description": "The identical file was already registered."},
                        409: {"description": "The id is taken by a different (or embedded) model."}})
async def upload_cost_model(body: Annotated[CostModelFile, Body(openapi_examples=_UPLOAD_EXAMPLES)],
                            state: State, response: Response) -> CostModelCreated:
    """Register a cost-model file (e.g. one fitted by ``dcp profile``); ids are immutable."""
    created = await asyncio.to_thread(_register, state, body, response)
    return CostModelCreated(id=body.id, digest=body.digest(), created=created)


@router.post("/fit", response_model=CostModelCreated, status_code=status.HTTP_201_CREATED,
             dependencies=[Writer],
             responses={200: {"description": "The identical fitted file was already registered."},
                        409: {"description": "The fitted id is taken by a different model."},
                        422: {"description": "Invalid profile (line and reason) or a fit refused "
                                             "for its held-out error (terms named)."}})
async def fit_cost_model(body: FitRequest, state: State, response: Response) -> CostModelCreated:
    """Fit a cost model to uploaded profiles (on the process pool) and register it."""
    options = body.options.model_dump(exclude_none=True)
    future = state.executor.submit_with_deadline(FIT_DEADLINE_S, fit_profile_texts,
                                                 list(body.profiles_jsonl), options)
    try:
        file = await asyncio.wrap_future(future)
    except (ValueError, DeadlineExceededError) as exc:
        unprocessable(["body", "profiles_jsonl"], str(exc))
    except BrokenProcessPool:
        service_unavailable("solver pool unavailable (a worker died); retry")
    created = await asyncio.to_thread(_register, state, file, response)
    return CostModelCreated(id=file.id, digest=file.digest(), created=created,
                            fit_quality=file.fit_quality)
