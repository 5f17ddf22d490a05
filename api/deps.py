"""Dependencies of the routers: the service state, the settings, the bearer-token check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.cost_model_store import CostModelConflictError, InvalidStoredCostModelError
from api.errors import conflict, not_found, unprocessable
from api.job_manager import JobManager
from api.metrics import Metrics
from api.pool import SolverPool
from api.recalibration import Recalibrator
from api.registry import CostModelRegistry, resolve_cluster
from api.settings import Settings
from api.store import PlanStore
from costmodel.analytic import analytic_cost_model
from costmodel.model_choice import select_model, with_loss_chunk
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec


@dataclass(kw_only=True, slots=True)
class ServiceState:
    """Everything the lifespan opens, shared by the routers."""

    settings: Settings
    """The settings the app was made with."""
    store: PlanStore
    """The plan store."""
    registry: CostModelRegistry
    """Cost models."""
    executor: SolverPool
    """The solver process pool."""
    jobs: JobManager
    """Epoch jobs."""
    metrics: Metrics
    """Prometheus metrics."""
    ready: bool = field(default=False)
    """True once the pool's workers are started."""
    recalibrator: Recalibrator | None = None
    """Measurements, cost-model revisions and re-planning (``api.recalibration``)."""

    def planning_inputs(self, *, cluster: str | ClusterSpec, cost_model_id: str | None,
                        model: str | None = None, model_config: dict[str, Any] | None = None,
                        loss_chunk_tokens: int | None = None, max_sample_tokens: int | None = None
                        ) -> tuple[ClusterSpec, CostModelFile]:
        """The cluster and the cost model of a request: the registered ``cost_model_id``, or the
        analytic cost model of ``model`` (a preset) or ``model_config`` (a config.json object) on
        the cluster's hardware, registered so that jobs, resumes and reports find it by id (reads
        and may write the store: call it on a worker thread). ``loss_chunk_tokens`` sets the
        model's LM loss chunk, at most ``max_sample_tokens`` when that is given.

        Raises:
            HTTPException: 422 at ``body.cluster`` for a bad cluster, at ``body.model`` /
                ``body.model_config`` for an unknown preset or a bad config, at
                ``body.loss_chunk_tokens`` for a chunk longer than the longest sample or for a
                video model; 404 for an unknown
                cost model, 409 for a stored cost model that no longer validates.
        """
        try:
            spec = resolve_cluster(cluster)
        except ValueError as exc:
            unprocessable(["body", "cluster"], str(exc))
        if cost_model_id is None:
            try:
                chosen = select_model(model=model, model_config=model_config, model_option="model",
                                      config_option="model_config")
            except ValueError as exc:
                unprocessable(["body", "model" if model is not None else "model_config"], str(exc))
            if chosen is None:
                unprocessable(["body"], "give exactly one of cost_model_id, model and model_config")
            try:
                chosen = with_loss_chunk(chosen, loss_chunk_tokens, max_sample_tokens=max_sample_tokens)
            except ValueError as exc:
                unprocessable(["body", "loss_chunk_tokens"], str(exc))
            try:
                return spec, self.registry.add_derived(analytic_cost_model(chosen, spec.hardware))
            except CostModelConflictError as exc:
                conflict(str(exc))
        try:
            return spec, self.registry.get(cost_model_id)
        except KeyError as exc:
            not_found(str(exc.args[0]))
        except InvalidStoredCostModelError as exc:
            conflict(str(exc))


async def get_state(request: Request) -> ServiceState:
    """The service state stored on the app by the lifespan."""
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(get_state)]

_bearer = HTTPBearer(auto_error=False,
                     description="With DCP_AUTH_TOKEN set: the write token for writes, it or DCP_READ_TOKEN "
                                 "for reads (api/auth.py).")


async def require_token(request: Request, state: State,
                        _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
                        ) -> None:
    """Check the token a route needs (no-op when no token is configured): reads take the read or
    the write token, writes the write token.

    ``api.limits.RequestGuardMiddleware`` already refused such a request before its body was
    read; this dependency documents the scheme in the OpenAPI document and keeps the check when
    the app runs without the guard.

    Raises:
        HTTPException: 401 when the token is missing or wrong (403: the read token on a write).
    """
    tokens = state.settings.tokens
    authorization = request.headers.get("authorization")
    if tokens.allows(request.method, request.url.path, authorization):
        return
    if tokens.can_read(authorization):
        raise HTTPException(status_code=status.HTTP_403_FORBIDDEN,
                            detail="the read token cannot write: use the write token (DCP_AUTH_TOKEN)")
    raise HTTPException(status_code=status.HTTP_401_UNAUTHORIZED,
                        detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


Writer = Depends(require_token)
"""A route's token check (kept under its old name: every route with a body is a write)."""
