"""Request and response models of the HTTP API (separate from the domain schemas)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from costmodel.schema import TermFit
from costmodel.specs import ClusterSpec, Sample
from planner.plan import Plan

EPOCH_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"

_SAMPLES_EXAMPLE: list[Any] = [
    {"id": "doc-17", "tokens": 8192},
    {"id": "doc-4", "tokens": 1024},
    {"id": "doc-99", "tokens": 65536},
]


class PlanOptions(BaseModel):
    """Planner options (fields of ``planner.config.PlannerConfig``; unknown names get a 422)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [{"time_limit_s": 0.5,
                                                                             "seed": 7}]})

    time_limit_s: float | None = Field(default=None, gt=0, le=600,
                                       description="Solver budget in seconds (default from settings).")
    seed: int | None = Field(default=None, ge=0, description="Seed of the planner's randomised parts.")

    def to_options(self, *, default_time_limit_s: float) -> dict[str, Any]:
        """The options as PlannerConfig keyword arguments, with the default budget filled in."""
        values = {k: v for k, v in self.model_dump().items() if v is not None}
        values.setdefault("time_limit_s", default_time_limit_s)
        return values


class PlanRequest(BaseModel):
    """Plan one global batch synchronously."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "samples": _SAMPLES_EXAMPLE, "cluster": "h200x8",
        "cost_model_id": "analytic-llama-7b-h200-sxm", "options": {"time_limit_s": 0.5}}]})

    samples: list[Sample] = Field(min_length=1, description="The global batch (unique ids).")
    cluster: str | ClusterSpec = Field(description="A cluster preset name or a full ClusterSpec.")
    cost_model_id: str = Field(min_length=1, description="Id from GET /v1/cost-models.")
    options: PlanOptions = Field(default_factory=PlanOptions, description="Planner options.")

    @model_validator(mode="after")
    def _unique_ids(self) -> PlanRequest:
        seen: set[str] = set()
        for sample in self.samples:
            if sample.id in seen:
                raise ValueError(f"duplicate sample id {sample.id!r}")
            seen.add(sample.id)
        return self


class PlanResponse(BaseModel):
    """A plan with its digest and gap to the lower bound."""

    plan: Plan = Field(description="The plan (solver wall time zeroed; see solve_time_s).")
    digest: str = Field(description="SHA-256 of the plan's canonical JSON.")
    gap: float = Field(description="predicted / lower bound - 1.")
    solve_time_s: float = Field(description="Planner wall time of this request.")


class BatchRuleModel(BaseModel):
    """The global batch rule: exactly one of samples_per_step and tokens_per_step."""

    model_config = ConfigDict(extra="forbid")

    samples_per_step: int | None = Field(default=None, gt=0, description="Samples per step.")
    tokens_per_step: int | None = Field(default=None, gt=0, description="Token budget per step.")

    @model_validator(mode="after")
    def _exactly_one(self) -> BatchRuleModel:
        if (self.samples_per_step is None) == (self.tokens_per_step is None):
            raise ValueError("give exactly one of samples_per_step and tokens_per_step")
        return self


class EpochRequest(BaseModel):
    """Start an epoch precompute job."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "epoch_id": "run42-epoch0",
        "manifest_jsonl": '{"id": "a", "tokens": 812}\n{"id": "b", "tokens": 30000}\n',
        "batch": {"samples_per_step": 256}, "seed": 0, "cluster": "h200x32",
        "cost_model_id": "analytic-llama-7b-h200-sxm", "options": {"time_limit_s": 0.2}}]})

    epoch_id: str | None = Field(default=None, pattern=EPOCH_ID_PATTERN,
                                 description="Id of the job (generated when absent; taken -> 409).")
    manifest_jsonl: str | None = Field(default=None, min_length=1,
                                       description="The manifest inline, as JSON Lines.")
    manifest_path: str | None = Field(default=None, min_length=1,
                                      description="A manifest file under the service's data directory.")
    batch: BatchRuleModel = Field(description="Samples or tokens per step.")
    seed: int = Field(default=0, ge=0, description="Shuffle seed; step seeds derive from it.")
    cluster: str | ClusterSpec = Field(description="A cluster preset name or a full ClusterSpec.")
    cost_model_id: str = Field(min_length=1, description="Id from GET /v1/cost-models.")
    options: PlanOptions = Field(default_factory=PlanOptions, description="Planner options.")

    @model_validator(mode="after")
    def _one_manifest(self) -> EpochRequest:
        if (self.manifest_jsonl is None) == (self.manifest_path is None):
            raise ValueError("give exactly one of manifest_jsonl and manifest_path")
        return self


class EpochSummary(BaseModel):
    """Means over the stored steps."""

    mean_predicted_speedup_vs_bucket: float | None = Field(description="Mean bucket time / plan time.")
    mean_gap: float | None = Field(description="Mean predicted / lower bound - 1.")
    mean_predicted_step_time_s: float | None = Field(description="Mean predicted step time.")


class EpochStatus(BaseModel):
    """Status of an epoch job."""

    epoch_id: str
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    steps_total: int
    steps_done: int
    progress: float = Field(description="steps_done / steps_total.")
    eta_s: float | None = Field(description="Estimated seconds to finish (None when unknown).")
    cluster_name: str
    cost_model_id: str
    seed: int
    batch: dict[str, int]
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    summary: EpochSummary


class StepPlan(BaseModel):
    """One stored step."""

    step: int
    digest: str
    plan: Plan


class CostModelInfo(BaseModel):
    """A registered cost model, without its coefficients."""

    id: str
    provenance: Literal["analytic", "fitted"]
    source: Literal["builtin", "uploaded"]
    model: str
    hardware: str
    digest: str
    notes: str


class CostModelCreated(BaseModel):
    """Answer to an upload or a fit."""

    id: str
    digest: str
    created: bool = Field(description="False when the identical file was already registered.")
    fit_quality: dict[str, TermFit] = Field(default_factory=dict,
                                            description="Held-out error per fitted term.")


class FitOptions(BaseModel):
    """Options of ``costmodel.fit.FitConfig``."""

    model_config = ConfigDict(extra="forbid")

    holdout_fraction: float | None = Field(default=None, gt=0, lt=1, description="Share held out.")
    max_mape: float | None = Field(default=None, gt=0, description="Refuse terms worse than this.")
    force: bool | None = Field(default=None, description="Keep a fit above max_mape (noted).")
    time_statistic: Literal["median", "min"] | None = Field(default=None, description="Timing to fit.")
    seed: int | None = Field(default=None, description="Seed of the hold-out split.")
    model_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]+$", max_length=200,
                                 description="Id of the fitted file (default fitted-<model>-<hw>).")


class FitRequest(BaseModel):
    """Fit a cost model to profiles made by ``dcp profile`` / ``dcp profile-comm``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "profiles_jsonl": ['{"record": "header", "format": "dcp-profile/1", ...}\n{"record": '
                           '"compute", ...}\n'],
        "options": {"max_mape": 0.1, "model_id": "fitted-llama-7b-h200-run3"}}]})

    profiles_jsonl: list[str] = Field(min_length=1, max_length=16,
                                      description="Profile files (dcp-profile/1 JSON Lines text).")
    options: FitOptions = Field(default_factory=FitOptions, description="Fit options.")
