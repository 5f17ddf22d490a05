"""The plan schema: what one optimizer step executes. A leaf module.

Both sides import it: the planner and the service produce plans, the executor in each rank
interprets them. It depends only on pydantic and the sample schema.

A plan partitions the ``num_ranks`` ranks into groups of contiguous ranks; each group runs its
ordered micro-batches (whole samples, each with a checkpoint policy: the number of layers it
recomputes). ``digest()`` identifies the plan exactly, so ranks can check they agree.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from costmodel.specs import Sample

PLAN_SCHEMA_VERSION = 2
"""Version 2 adds the solver status ``POLISHED_BASELINE`` (a polished baseline was ``HEURISTIC``
in version 1). Plans of every version in ``SUPPORTED_PLAN_SCHEMA_VERSIONS`` load as they are."""

SUPPORTED_PLAN_SCHEMA_VERSIONS = (1, 2)

SolverStatus = Literal["OPTIMAL", "FEASIBLE", "HEURISTIC", "BASELINE", "POLISHED_BASELINE"]
"""Where the plan came from. The search's own result: OPTIMAL/FEASIBLE (CP-SAT's answer) or
HEURISTIC (the heuristic's plan, CP-SAT finding nothing better in time or not run). A baseline
beat the search: BASELINE (its plan as it is; ``method`` names it) or POLISHED_BASELINE (its groups
improved by the search's moves and policies; ``method`` is ``<baseline>+search``)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PlannedSample(_Frozen):
    """A sample as placed in a micro-batch."""

    sample: Sample = Field(description="The sample (id and shape).")
    recompute_layers: int = Field(ge=0, description="Checkpoint policy: 0 = none, L = full, else selective.")
    predicted_time_s: float = Field(ge=0, description="Predicted forward+backward time on its group.")
    predicted_activation_bytes: float = Field(ge=0, description="Predicted activation bytes per rank.")


class MicroBatch(_Frozen):
    """One forward+backward of a group: whole samples, packed, attention within each sample."""

    samples: list[PlannedSample] = Field(min_length=1, description="Samples in execution order.")
    predicted_time_s: float = Field(ge=0, description="Predicted time including the fixed overhead.")
    predicted_peak_mem_bytes: float = Field(ge=0, description="Predicted peak bytes per rank.")


class GroupPlan(_Frozen):
    """One SP group and its work for the step."""

    ranks: list[int] = Field(min_length=1, description="Contiguous global ranks, ascending.")
    micro_batches: list[MicroBatch] = Field(default_factory=list, description="Run one after another.")
    predicted_time_s: float = Field(ge=0, description="Sum of the micro-batch times.")
    predicted_peak_mem_bytes: float = Field(ge=0, description="Max micro-batch peak bytes per rank.")
    ring_degree: int = Field(default=1, ge=1, description=(
        "Attention layout: the group runs Ulysses over size/ring_degree ranks and ring attention over "
        "ring_degree rank-sets (executor/ring_layout.py); 1 = pure Ulysses, size = pure ring. Left out "
        "of the JSON when 1, so pure-Ulysses plans keep their bytes and digests."))
    ring_saving_s: float | None = Field(default=None, description=(
        "Why a ring: for a group with ring_degree > 1, the predicted time this group saves against pure "
        "Ulysses of its size on the same ranks and samples (negative: the ring is slower, as a fixed "
        "baseline may run it); null where no pure-Ulysses group of that size holds them (past the heads, "
        "or over the memory budget). Left out of the JSON when null."))

    @model_validator(mode="after")
    def _contiguous(self) -> GroupPlan:
        first = self.ranks[0]
        if self.ranks != list(range(first, first + len(self.ranks))):
            raise ValueError(f"group ranks {self.ranks} are not contiguous ascending")
        if len(self.ranks) % self.ring_degree != 0:
            raise ValueError(f"group of ranks {first}..{self.ranks[-1]}: ring_degree={self.ring_degree} does not "
                             f"divide the group size {len(self.ranks)}")
        return self

    @model_serializer(mode="wrap")
    def _omit_default_layout(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # No return annotation: pydantic then keeps the model's own serialization schema (OpenAPI)
        data: dict[str, object] = handler(self)
        if self.ring_degree == 1:
            data.pop("ring_degree", None)
        if self.ring_saving_s is None:
            data.pop("ring_saving_s", None)
        return data

    @property
    def ulysses_degree(self) -> int:
        """Ranks that swap sequence for heads: ``size // ring_degree``."""
        return len(self.ranks) // self.ring_degree

    @property
    def size(self) -> int:
        """Group size ``d``."""
        return len(self.ranks)

    @property
    def first_rank(self) -> int:
        """Lowest rank of the group."""
        return self.ranks[0]


class SolverInfo(_Frozen):
    """How the plan was found."""

    status: SolverStatus = Field(description="See ``SolverStatus``.")
    method: str = Field(description="e.g. 'cpsat', 'heuristic', 'bucket', 'packed', 'greedy'.")
    wall_time_s: float = Field(ge=0, description="Planner wall time.")
    objective_bound_s: float | None = Field(default=None, description="Solver's proven bound, if any.")
    seed: int = Field(default=0, description="Seed of the planner's randomised parts.")


class LowerBound(_Frozen):
    """A proven lower bound of the step time under the cost model."""

    value_s: float = Field(ge=0, description="The bound in seconds.")
    kind: str = Field(description="Which bound is the tightest (e.g. 'longest', 'area', 'cpsat').")


class LossNormalizer(_Frozen):
    """What each rank divides its summed local loss by, so the step is the large-batch step."""

    kind: Literal["tokens", "samples"] = Field(description="Normalise by tokens or by samples.")
    total: int = Field(gt=0, description="Global count over the whole step.")


class Plan(_Frozen):
    """One step's plan (docs/design.md, 'Terms')."""

    schema_version: int = Field(default=PLAN_SCHEMA_VERSION, description="Wire schema version.")
    step: int | None = Field(default=None, ge=0, description="Step index inside its epoch, if any.")
    num_ranks: int = Field(gt=0, description="World size N.")
    groups: list[GroupPlan] = Field(min_length=1, description="A partition of the ranks.")
    predicted_step_time_s: float = Field(ge=0, description="max group time + gradient sync.")
    grad_sync_time_s: float = Field(ge=0, description="Predicted gradient sync time.")
    lower_bound: LowerBound = Field(description="A lower bound of the step time.")
    solver: SolverInfo = Field(description="How the plan was found.")
    loss_normalizer: LossNormalizer = Field(description="Global loss normaliser.")
    cost_model_id: str = Field(min_length=1, description="Id of the cost model used.")
    cluster_name: str = Field(min_length=1, description="Name of the cluster it is for.")
    baselines_s: dict[str, float] = Field(
        default_factory=dict, description="Predicted step time of each baseline, same cost model."
    )

    @model_validator(mode="after")
    def _check(self) -> Plan:
        if self.schema_version not in SUPPORTED_PLAN_SCHEMA_VERSIONS:
            raise ValueError(f"schema_version={self.schema_version} is not supported "
                             f"(expected one of {SUPPORTED_PLAN_SCHEMA_VERSIONS})")
        if self.schema_version < 2 and self.solver.status == "POLISHED_BASELINE":
            raise ValueError("solver.status='POLISHED_BASELINE' needs schema_version 2 "
                             f"(got {self.schema_version})")
        ranks = sorted(r for g in self.groups for r in g.ranks)
        if ranks != list(range(self.num_ranks)):
            raise ValueError(f"groups do not partition ranks 0..{self.num_ranks - 1}: got {ranks}")
        return self

    @property
    def gap(self) -> float:
        """``predicted / bound - 1`` (0 when the bound is 0)."""
        if self.lower_bound.value_s <= 0:
            return 0.0
        return self.predicted_step_time_s / self.lower_bound.value_s - 1.0

    @property
    def sample_ids(self) -> list[str]:
        """Ids of every sample in the plan, in group then micro-batch order."""
        return [ps.sample.id for g in self.groups for mb in g.micro_batches for ps in mb.samples]

    def group_of_rank(self, rank: int) -> GroupPlan:
        """The group that holds ``rank``.

        Raises:
            ValueError: when the rank is outside the world.
        """
        for group in self.groups:
            if rank in group.ranks:
                return group
        raise ValueError(f"rank {rank} is not in this plan's world of {self.num_ranks}")

    def canonical_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): the bytes the digest covers."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """SHA-256 hex digest of the canonical JSON."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def content_json(self) -> str:
        """Canonical JSON without ``solver.wall_time_s``, the one field that differs between
        two runs of the planner on the same input and seed (what determinism is defined on)."""
        data = self.model_dump(mode="json")
        data["solver"].pop("wall_time_s", None)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def content_digest(self) -> str:
        """SHA-256 hex digest of :meth:`content_json`: equal for equal input and seed."""
        return hashlib.sha256(self.content_json().encode()).hexdigest()

    def rank_view(self, rank: int) -> RankPlan:
        """The part of the plan rank ``rank`` executes, with the digest of the whole plan."""
        group = self.group_of_rank(rank)
        return RankPlan(
            step=self.step,
            rank=rank,
            num_ranks=self.num_ranks,
            group=group,
            group_sizes=[g.size for g in self.groups],
            ring_degrees=([g.ring_degree for g in self.groups] if any(g.ring_degree > 1 for g in self.groups)
                          else None),
            loss_normalizer=self.loss_normalizer,
            plan_digest=self.digest(),
            cost_model_id=self.cost_model_id,
        )


class RankPlan(_Frozen):
    """What one rank needs: its group, its micro-batches, and the digest of the whole plan."""

    schema_version: int = Field(default=PLAN_SCHEMA_VERSION, description="Wire schema version.")
    step: int | None = Field(default=None, ge=0, description="Step index inside its epoch.")
    rank: int = Field(ge=0, description="The rank this view is for.")
    num_ranks: int = Field(gt=0, description="World size N.")
    group: GroupPlan = Field(description="The rank's group and its micro-batches.")
    group_sizes: list[int] = Field(description="Sizes of all groups in rank order (layout check).")
    ring_degrees: list[int] | None = Field(default=None, description=(
        "Ring degree of all groups in rank order (layout check); left out when every group is pure Ulysses."))
    loss_normalizer: LossNormalizer = Field(description="Global loss normaliser.")
    plan_digest: str = Field(min_length=64, max_length=64, description="Digest of the whole plan.")
    cost_model_id: str = Field(description="Id of the cost model used.")

    @model_serializer(mode="wrap")
    def _omit_default_layout(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # No return annotation: pydantic then keeps the model's own serialization schema (OpenAPI)
        data: dict[str, object] = handler(self)
        if self.ring_degrees is None:
            data.pop("ring_degrees", None)
        return data

    @property
    def index_in_group(self) -> int:
        """Position of this rank inside its group."""
        return self.rank - self.group.first_rank
