"""Request and response models of the HTTP API (separate from the domain schemas)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from costmodel.model_config import model_spec_from_config
from costmodel.schema import TermFit
from costmodel.specs import ClusterSpec, HardwareSpec, Sample
from planner.limits import (  # the limits the CLI applies too; the batch cap also bounds the
    MAX_ID_CHARS,  # work of validating a request's list on the event loop
    MAX_SAMPLE_DIM,
    MAX_SAMPLE_TOKENS,
    MAX_SAMPLES_PER_REQUEST,
    MAX_SEED,
)
from planner.plan import Plan

EPOCH_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"

_SAMPLES_EXAMPLE: list[Any] = [
    {"id": "doc-17", "tokens": 8192},
    {"id": "doc-4", "tokens": 1024},
    {"id": "doc-99", "tokens": 65536},
]


MAX_NUM_GPUS = 65536
"""Largest world of an inline cluster spec."""
MAX_TIME_LIMIT_S = 60.0
"""Largest per-plan wall-clock limit a request may ask for."""

PosInt = Annotated[int, Field(strict=True, gt=0)]


def _count(maximum: int, description: str, *, minimum: int = 0) -> Any:
    return Field(default=None, strict=True, ge=minimum, le=maximum, description=description)


class PlanOptions(BaseModel):
    """Planner options: fields of ``planner.config.PlannerConfig``, each bounded (unknown names,
    floats given for counts and out-of-range values get a 422 naming the field).

    The work limits are capped far above the ``PlannerConfig.for_budget(1.0)`` preset; whatever
    they are, the service stops a plan at ``time_limit_s`` plus a small margin."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"time_limit_s": 0.5,
                                                                              "seed": 7}]})

    time_limit_s: float | None = Field(default=None, strict=True, gt=0, le=MAX_TIME_LIMIT_S,
                                       description="Wall-clock limit of the plan in seconds "
                                                   "(default from settings); enforced by the service.")
    seed: int | None = _count(MAX_SEED, "Seed of the planner's randomised parts.")
    cpsat_deterministic_time: float | None = Field(default=None, strict=True, gt=0, le=60.0,
                                                   description="CP-SAT budget in deterministic units.")
    num_workers: int | None = _count(8, "CP-SAT search workers.", minimum=1)
    sizes: Literal["pow2", "any"] | None = Field(default=None, description="Allowed group sizes.")
    max_group_size: int | None = _count(MAX_NUM_GPUS, "Largest group size.", minimum=1)
    group_sizes: list[PosInt] | None = Field(default=None, min_length=1, max_length=64,
                                             description="Explicit allowed group sizes.")
    layout: Literal["auto", "ulysses", "ring"] | None = Field(
        default=None, description="Attention layouts groups may run (planner/layouts.py): auto (the "
                                  "service's default: Ulysses x ring chosen per group, sizes past the heads as "
                                  "rings), ulysses or ring; "
                                  "an executor runs ring groups only if its registry was given their layouts.")
    loss_normalization: Literal["tokens", "samples"] | None = Field(default=None,
                                                                    description="Loss normaliser.")
    use_cpsat: bool | None = Field(default=None, strict=True, description="Run CP-SAT after the heuristic.")
    aggregated_cpsat: bool | None = Field(default=None, strict=True,
                                          description="CP-SAT large-neighbourhood search after the "
                                                      "heuristic (name kept for compatibility).")
    exact_max_samples: int | None = _count(32, "Largest batch for the exact CP-SAT model.")
    exact_max_ranks: int | None = _count(32, "Largest world for the exact CP-SAT model.")
    exact_time_limit_s: float | None = Field(default=None, strict=True, gt=0, le=MAX_TIME_LIMIT_S,
                                             description="Wall-clock cap of the exact model.")
    local_search_max_moves: int | None = _count(20000, "Most improving local-search moves.")
    local_search_max_ejections: int | None = _count(1000, "Most one-for-many swaps.")
    max_resize_tries: int | None = _count(256, "Most split / merge moves.")
    deep_search_min_gap: float | None = Field(default=None, strict=True, ge=0, le=10,
                                              description="Gap above which the deep search runs.")
    num_candidate_partitions: int | None = _count(1024, "Most group-size multisets.", minimum=1)
    num_lpt_runs: int | None = _count(1000, "Most LPT runs of the heuristic.", minimum=1)
    num_refined: int | None = _count(64, "Multisets refined by bisection and local search.", minimum=1)
    num_target_probes: int | None = _count(64, "Bisection steps per refined multiset.")
    bucket_tolerance: float | None = Field(default=None, strict=True, ge=0, lt=1,
                                           description="Relative work difference of bulk placement.")
    lp_bound_iterations: int | None = _count(64, "Bisection steps of the partition LP bound.")
    lp_bound_integral: bool | None = Field(default=None, strict=True, description="Whole group counts.")
    lp_bound_min_gap: float | None = Field(default=None, strict=True, ge=0, le=10,
                                           description="Gap above which the LP bound runs.")
    lp_bound_micro_batch_buckets: int | None = _count(
        8, "Micro-batch counts the partition LP tells apart (1 .. M-1 and at least M).", minimum=1)
    compute_baselines: bool | None = Field(default=None, strict=True, description="Compute baselines.")
    baseline_group_size: int | None = _count(MAX_NUM_GPUS, "Fixed SP size of the baselines.", minimum=1)
    memory_safety_fraction: float | None = Field(default=None, strict=True, ge=0, lt=0.5,
                                                 description="Slack kept below the memory cap.")

    def to_options(self, *, default_time_limit_s: float, default_layout: str = "auto") -> dict[str, Any]:
        """The options as PlannerConfig keyword arguments, with the default budget and layout filled
        in (an epoch stores its layout explicitly: ``planner.epoch.epoch_options`` reads a job stored
        without one, from when ``ulysses`` was the default, as ``ulysses``)."""
        values = {k: v for k, v in self.model_dump().items() if v is not None}
        if "group_sizes" in values:
            values["group_sizes"] = tuple(values["group_sizes"])
        values.setdefault("time_limit_s", default_time_limit_s)
        values.setdefault("layout", default_layout)
        return values


class HardwareIn(HardwareSpec):
    """An accelerator given inline, every figure finite and physically plausible."""

    name: str = Field(min_length=1, max_length=MAX_ID_CHARS, description="Name of the accelerator.")
    hbm_bytes: float = Field(ge=1e6, le=1e15, description="Device memory in bytes.")
    hbm_bandwidth_bytes_per_s: float = Field(ge=1e6, le=1e16, description="Device memory bandwidth.")
    bf16_dense_flops: float = Field(ge=1e6, le=1e19, description="Peak dense bf16 FLOP/s.")
    nvlink_bytes_per_s_per_direction: float = Field(ge=1e3, le=1e16,
                                                    description="Intra-node link bandwidth per GPU.")
    network_bytes_per_s_per_gpu: float = Field(ge=1e3, le=1e16, description="Inter-node bandwidth per GPU.")


class ClusterIn(ClusterSpec):
    """A cluster given inline (``ClusterSpec`` with bounded sizes)."""

    schema_version: int = Field(default=ClusterSpec.model_fields["schema_version"].default, strict=True,
                                ge=1, le=1000, description="Wire schema version.")
    name: str = Field(min_length=1, max_length=MAX_ID_CHARS, description="Name of the cluster.")
    hardware: HardwareIn = Field(description="The accelerator of every rank.")
    num_gpus: int = Field(strict=True, gt=0, le=MAX_NUM_GPUS, description="World size N.")
    gpus_per_node: int = Field(strict=True, gt=0, le=1024, description="GPUs per node G.")

    def to_spec(self) -> ClusterSpec:
        """The plain domain spec."""
        return ClusterSpec.model_validate(self.model_dump())


class SampleIn(Sample):
    """A sample of a request (``Sample`` with bounded sizes)."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS, description="Stable id of the sample.")
    tokens: int = Field(strict=True, gt=0, le=MAX_SAMPLE_TOKENS, description="Sequence length in tokens.")
    frames: int | None = Field(default=None, strict=True, gt=0, le=MAX_SAMPLE_DIM,
                               description="Latent frames (2D only).")
    height: int | None = Field(default=None, strict=True, gt=0, le=MAX_SAMPLE_DIM,
                               description="Latent height in patches (2D only).")
    width: int | None = Field(default=None, strict=True, gt=0, le=MAX_SAMPLE_DIM,
                              description="Latent width in patches (2D only).")

    def to_sample(self) -> Sample:
        """The plain domain sample."""
        return Sample.model_construct(**{k: getattr(self, k) for k in Sample.model_fields})


ClusterField = Annotated[str | ClusterIn, Field(description="A cluster preset name (GET /v1/cost-models "
                                                            "names none; see costmodel/presets) or a full "
                                                            "ClusterSpec.")]
CostModelIdField = Annotated[str, Field(min_length=1, max_length=200, description="Id from GET /v1/cost-models.")]


ModelField = Annotated[str | None, Field(default=None, min_length=1, max_length=MAX_ID_CHARS,
                                        description="A model preset (costmodel/presets/models.json) "
                                                    "instead of cost_model_id: its analytic cost model "
                                                    "on the cluster's hardware.")]
MAX_MODEL_CONFIG_KEYS = 1024
"""Most top-level fields of an inline model config (real ones have a few dozen)."""


def _check_model_config(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A model config the service can read (``costmodel.model_config``), or a 422 naming it."""
    if value is None:
        return None
    if len(value) > MAX_MODEL_CONFIG_KEYS:
        raise ValueError(f"{len(value)} fields exceed the limit of {MAX_MODEL_CONFIG_KEYS}")
    model_spec_from_config(value, source="model_config")
    return value


class _ModelChoice(BaseModel):
    """Exactly one of ``cost_model_id``, ``model`` and ``model_config`` (the model planned for)."""

    cost_model_id: CostModelIdField | None = None
    model: ModelField = None
    model_config_json: dict[str, Any] | None = Field(
        default=None, alias="model_config", max_length=MAX_MODEL_CONFIG_KEYS,
        description="A transformers (Llama, Qwen2/3, Mistral) or diffusers (WanTransformer3DModel, "
                    "HunyuanVideoTransformer3DModel) config.json object instead of cost_model_id: its "
                    "analytic cost model on the cluster's hardware. A bad field gets a 422 naming it.")
    loss_chunk_tokens: int | None = Field(
        default=None, strict=True, ge=0, le=2**40,
        description="Tokens per chunk of the LM loss (text models, with model or model_config): a rank "
                    "never holds more logits than this (ModelSpec.loss_chunk_tokens, default 4096); 0 "
                    "holds whole logits. At most the longest sample's tokens.")

    @model_validator(mode="after")
    def _one_model(self) -> _ModelChoice:
        given = [name for name, value in (("cost_model_id", self.cost_model_id), ("model", self.model),
                                          ("model_config", self.model_config_json)) if value is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of cost_model_id, model and model_config"
                             + (f", not {' and '.join(given)}" if given else ""))
        if self.loss_chunk_tokens is not None and self.cost_model_id is not None:
            raise ValueError(f"loss_chunk_tokens={self.loss_chunk_tokens} applies to the analytic cost model "
                             "of model or model_config; cost model "
                             f"{self.cost_model_id!r} charges the loss as it was made")
        return self

    @field_validator("model_config_json")
    @classmethod
    def _readable_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_model_config(value)

    @property
    def model_field(self) -> str:
        """The request field that names the model."""
        if self.cost_model_id is not None:
            return "cost_model_id"
        return "model" if self.model is not None else "model_config"


def as_cluster(cluster: str | ClusterIn) -> str | ClusterSpec:
    """A request's cluster for the domain code (a preset name, or the plain spec)."""
    return cluster.to_spec() if isinstance(cluster, ClusterIn) else cluster


class PlanRequest(_ModelChoice):
    """Plan one global batch synchronously, under a cost model (``cost_model_id``) or a model's
    analytic one (``model`` or ``model_config``)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "samples": _SAMPLES_EXAMPLE, "cluster": "h200x8",
        "cost_model_id": "analytic-llama-7b-h200-sxm", "options": {"time_limit_s": 0.5}}]})

    samples: list[SampleIn] = Field(min_length=1, max_length=MAX_SAMPLES_PER_REQUEST,
                                    description="The global batch (unique ids).")
    cluster: ClusterField
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

    samples_per_step: int | None = Field(default=None, strict=True, gt=0, le=MAX_SAMPLES_PER_REQUEST,
                                         description="Samples per step.")
    tokens_per_step: int | None = Field(default=None, strict=True, gt=0, le=2**40,
                                        description="Token budget per step.")

    @model_validator(mode="after")
    def _exactly_one(self) -> BatchRuleModel:
        if (self.samples_per_step is None) == (self.tokens_per_step is None):
            raise ValueError("give exactly one of samples_per_step and tokens_per_step")
        return self


class EpochRequest(_ModelChoice):
    """Start an epoch precompute job, under a cost model (``cost_model_id``) or a model's analytic
    one (``model`` or ``model_config``, registered so that the job's resume finds it)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "epoch_id": "run42-epoch0",
        "manifest_jsonl": '{"id": "a", "tokens": 812}\n{"id": "b", "tokens": 30000}\n',
        "batch": {"samples_per_step": 256}, "seed": 0, "cluster": "h200x32",
        "cost_model_id": "analytic-llama-7b-h200-sxm", "options": {"time_limit_s": 0.2}}]})

    epoch_id: str | None = Field(default=None, pattern=EPOCH_ID_PATTERN,
                                 description="Id of the job (generated when absent; taken -> 409).")
    manifest_jsonl: str | None = Field(default=None, min_length=1,
                                       description="The manifest inline, as JSON Lines (the body "
                                                   "size limit bounds it).")
    manifest_path: str | None = Field(default=None, min_length=1, max_length=1024,
                                      description="A manifest file under the service's data directory.")
    batch: BatchRuleModel = Field(description="Samples or tokens per step.")
    seed: int = Field(default=0, strict=True, ge=0, le=2**63 - 1,
                      description="Shuffle seed; step seeds derive from it.")
    cluster: ClusterField
    options: PlanOptions = Field(default_factory=PlanOptions, description="Planner options.")

    @model_validator(mode="after")
    def _one_manifest(self) -> EpochRequest:
        if (self.manifest_jsonl is None) == (self.manifest_path is None):
            raise ValueError("give exactly one of manifest_jsonl and manifest_path")
        return self


class EpochSummary(BaseModel):
    """Means over the stored steps."""

    mean_predicted_speedup_vs_strongest: float | None = Field(
        default=None, description="The headline: mean over steps of the strongest baseline's time (the "
        "fastest but naive at that step) / plan time.")
    mean_predicted_speedup_vs_bucket: float | None = Field(
        description="Mean bucket-sp4 time / plan time (the DCP paper's comparison, not the headline).")
    mean_gap: float | None = Field(description="Mean predicted / lower bound - 1.")
    mean_predicted_step_time_s: float | None = Field(description="Mean predicted step time.")
    steps_vs_strongest: int = Field(default=0, description="Steps the strongest-baseline mean is over "
                                    "(those where some baseline could plan).")
    steps_vs_bucket: int = Field(default=0, description="Steps the bucket-sp4 mean is over (those where "
                                 "bucket-sp4 could hold the batch).")


class EpochStatus(BaseModel):
    """Status of an epoch job."""

    epoch_id: str
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    steps_total: int
    steps_done: int
    progress: float = Field(description="steps_done / steps_total.")
    eta_s: float | None = Field(description="Estimated seconds to finish (None when unknown).")
    steps_per_s: float | None = Field(default=None, description="Steps stored per second by the "
                                      "job's latest run in this server: so far while it runs, over the "
                                      "whole run once it ended (None when it has not run here).")
    cluster_name: str
    cost_model_id: str
    seed: int
    batch: dict[str, int]
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    transient: bool = Field(default=False, description="The last failure was transient (killed "
                            "worker, full disk, locked store): the job is retried with backoff.")
    attempts: int = Field(default=0, description="Transient failures since the last success or resume.")
    retry_in_s: float | None = Field(
        default=None, description="Set while the job waits out a passing fault named in `error` (a store "
        "that cannot be written, a killed worker): seconds until it retries by itself (0: retrying "
        "now); `state` is then `queued`. None otherwise.")
    layouts: list[tuple[int, int, int]] | None = Field(
        default=None, description="Every attention layout `(size, ulysses_degree, ring_degree)` this epoch's "
        "plans may give a group (its `layout` option; `ring_degree` 1: pure Ulysses): the process groups an "
        "executor creates (`executor.groups.GroupRegistry.from_layouts`). None for epochs stored before "
        "epochs declared them.")
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
    max_mape: float | None = Field(default=None, gt=0, le=100, description="Refuse terms worse than this.")
    force: bool | None = Field(default=None, strict=True, description="Keep a fit above max_mape (noted).")
    time_statistic: Literal["median", "min"] | None = Field(default=None, description="Timing to fit.")
    seed: int | None = Field(default=None, strict=True, ge=0, le=2**32 - 1,
                             description="Seed of the hold-out split.")
    model_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]+$", max_length=200,
                                 description="Id of the fitted file (default fitted-<model>-<hw>).")
    hardware: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]+$", max_length=200,
                                 description="Hardware the fitted file describes (default: the profile's).")
    attention_half_tokens: float | None = Field(
        default=None, ge=0, le=1e9,
        description="Fix the attention half-performance length (tokens per rank) instead of fitting it.")


class FitRequest(BaseModel):
    """Fit a cost model to profiles made by ``dcp profile`` / ``dcp profile-comm``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "profiles_jsonl": ['{"record": "header", "format": "dcp-profile/4", ...}\n{"record": '
                           '"compute", ...}\n'],
        "options": {"max_mape": 0.1, "model_id": "fitted-llama-7b-h200-run3"}}]})

    profiles_jsonl: list[str] = Field(min_length=1, max_length=16,
                                      description="Profile files (dcp-profile/4 JSON Lines text; "
                                                  "/1, /2 and /3 are read).")
    options: FitOptions = Field(default_factory=FitOptions, description="Fit options.")
