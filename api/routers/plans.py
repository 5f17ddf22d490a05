"""``POST /v1/plans``: plan one global batch synchronously, on the process pool."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from concurrent.futures.process import BrokenProcessPool

from fastapi import APIRouter, HTTPException, Response, status

from api.deps import State, Writer
from api.errors import unprocessable
from api.registry import check_compatible
from api.schemas import PlanRequest, PlanResponse
from planner.epoch import build_config, plan_samples

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/plans", tags=["plans"])


@router.post("", response_model=PlanResponse, dependencies=[Writer],
             responses={404: {"description": "Unknown cost model."},
                        422: {"description": "Invalid batch, cluster or options; a sample that "
                                             "fits nowhere (named)."}})
async def create_plan(body: PlanRequest, state: State) -> Response:
    """Plan one global batch: groups, micro-batches and checkpoint policies, with bound and gap.

    The solver runs in the service's process pool; the event loop keeps serving meanwhile.
    """
    limit = state.settings.max_samples_per_batch
    if len(body.samples) > limit:
        unprocessable(["body", "samples"], f"{len(body.samples)} samples exceed the limit of {limit}")
    cluster, cost_model = state.planning_inputs(cluster=body.cluster, cost_model_id=body.cost_model_id)
    try:
        check_compatible(cost_model, cluster)
    except ValueError as exc:
        unprocessable(["body", "cost_model_id"], str(exc))
    options = body.options.to_options(default_time_limit_s=state.settings.plan_time_limit_s)
    try:
        build_config(options)
    except ValueError as exc:
        unprocessable(["body", "options"], str(exc))
    call = functools.partial(plan_samples, list(body.samples), cluster=cluster,
                             cost_model=cost_model, options=options, with_group_views=False)
    try:
        result = await asyncio.get_running_loop().run_in_executor(state.executor, call)
    except ValueError as exc:
        unprocessable(["body", "samples"], str(exc))
    except BrokenProcessPool:
        logger.exception("solver pool broke")
        raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                            detail="solver pool unavailable; retry") from None
    state.metrics.solver_latency_s.labels("sync").observe(result.solve_time_s)
    # The worker validated the plan and made its canonical JSON: send those bytes as they are.
    content = (f'{{"plan":{result.plan_json},"digest":"{result.digest}",'
               f'"gap":{json.dumps(result.gap)},"solve_time_s":{json.dumps(result.solve_time_s)}}}')
    return Response(content=content, media_type="application/json")
