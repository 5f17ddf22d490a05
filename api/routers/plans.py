"""``POST /v1/plans``: plan one global batch synchronously, on the process pool."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from concurrent.futures.process import BrokenProcessPool
from typing import NoReturn

from fastapi import APIRouter, Response

from api.deps import State, Writer
from api.errors import COMMON_RESPONSES, service_unavailable, unprocessable
from api.jobs import planner_wall_cap_s
from api.pool import DeadlineExceededError
from api.registry import check_compatible
from api.schemas import PlanRequest, PlanResponse, as_cluster
from api.strictjson import StrictJSONRoute
from costmodel.model_choice import check_samples_kind
from planner.epoch import StepResult, build_config, plan_samples

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/plans", tags=["plans"], route_class=StrictJSONRoute,
                   responses=COMMON_RESPONSES)


@router.post("", response_model=PlanResponse, dependencies=[Writer],
             responses={404: {"description": "Unknown cost model."},
                        409: {"description": "The stored cost model no longer validates."},
                        422: {"description": "Invalid batch, cluster or options; a sample that "
                                             "fits nowhere (named); a plan past time_limit_s."}})
async def create_plan(body: PlanRequest, state: State) -> Response:
    """Plan one global batch: groups, micro-batches and checkpoint policies, with bound and gap.

    The solver runs in the service's process pool; the event loop keeps serving meanwhile.
    The plan is stopped at ``options.time_limit_s`` (``exact_time_limit_s`` for the tiny batches
    the exact CP-SAT model proves) plus ``DCP_PLAN_DEADLINE_MARGIN_S``, whatever the other
    options ask for.
    """
    limit = state.settings.max_samples_per_batch
    if len(body.samples) > limit:
        unprocessable(["body", "samples"], f"{len(body.samples)} samples exceed the limit of {limit}")
    cluster, cost_model = await asyncio.to_thread(state.planning_inputs, cluster=as_cluster(body.cluster),
                                                  cost_model_id=body.cost_model_id, model=body.model,
                                                  model_config=body.model_config_json,
                                                  loss_chunk_tokens=body.loss_chunk_tokens,
                                                  max_sample_tokens=max(s.tokens for s in body.samples))
    try:
        check_compatible(cost_model, cluster)
    except ValueError as exc:
        unprocessable(["body", body.model_field], str(exc))
    options = body.options.to_options(default_time_limit_s=state.settings.plan_time_limit_s,
                                      default_layout=state.settings.plan_layout)
    try:
        build_config(options)
    except ValueError as exc:
        unprocessable(["body", "options"], str(exc))
    samples = [s.to_sample() for s in body.samples]
    try:
        check_samples_kind(samples, cost_model.model, source="samples")
    except ValueError as exc:
        unprocessable(["body", "samples"], str(exc))
    cap_s = planner_wall_cap_s(options, num_gpus=cluster.num_gpus, num_samples=len(samples))
    deadline_s = cap_s + state.settings.plan_deadline_margin_s
    start = time.monotonic()
    try:
        future = state.executor.submit_with_deadline(
            deadline_s, plan_samples, samples, cluster=cluster, cost_model=cost_model, options=options,
            with_group_views=False)
        result: StepResult = await asyncio.wrap_future(future)
    except ValueError as exc:
        unprocessable(["body", "samples"], str(exc))
    except DeadlineExceededError:
        _past_deadline(len(samples), cluster.num_gpus, cap_s)
    except BrokenProcessPool:
        if time.monotonic() - start > deadline_s:
            _past_deadline(len(samples), cluster.num_gpus, cap_s)
        logger.warning("solver pool broke while planning a request")
        service_unavailable("solver pool unavailable (a worker died); retry")
    if not (math.isfinite(result.gap) and math.isfinite(result.predicted_step_time_s)):
        unprocessable(["body", "cluster"], "the plan's predicted times are not finite: check the "
                      "cluster's hardware figures and the cost model's coefficients")
    state.metrics.solver_latency_s.labels("sync").observe(result.solve_time_s)
    state.metrics.count_dropped_bounds(result.dropped_bounds, path="sync")
    # The worker validated the plan and made its canonical JSON: send those bytes as they are.
    content = (f'{{"plan":{result.plan_json},"digest":"{result.digest}",'
               f'"gap":{json.dumps(result.gap)},"solve_time_s":{json.dumps(result.solve_time_s)}}}')
    return Response(content=content, media_type="application/json")


def _past_deadline(num_samples: int, num_gpus: int, time_limit_s: float) -> NoReturn:
    unprocessable(["body", "options", "time_limit_s"],
                  f"planning {num_samples} samples on {num_gpus} GPUs did not finish within "
                  f"its wall-clock limit of {time_limit_s:g} s (time_limit_s); raise time_limit_s or "
                  "lower the work options (num_lpt_runs, local_search_max_moves, max_resize_tries, ...)")
