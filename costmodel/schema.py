"""The cost-model file: fitted or analytic coefficients of the functional forms of DESIGN.md.

A leaf module. One file describes one model shape on one accelerator kind; the cluster
(world size, nodes, sharding) is applied when the file is evaluated (``costmodel.evaluate``).

Functional forms (per transformer layer, on one GPU; divide by the SP group size ``d``):

* forward time  ``= per_token*s + per_attn_pair*P + per_spatial_pair*Ps + per_temporal_pair*Pt``
  plus ``per_sample`` (not divided by ``d``), where for a 1D sample of ``s`` tokens ``P = s^2``
  and for a 2D sample of ``f`` frames of ``hw`` tokens ``Ps = f*(hw)^2``, ``Pt = hw*f^2``;
* backward time: the same form with its own coefficients;
* a layer recomputed under checkpointing costs one more forward;
* activation bytes per token per layer: ``none`` (all kept) or ``full`` (block input only);
* all-to-all: alpha-beta per placement (intra-node, inter-node), optionally per group size.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from costmodel.specs import ModelSpec

COST_MODEL_SCHEMA_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LayerTimeTerms(_Frozen):
    """Seconds per unit of each feature for one layer on one GPU."""

    per_token: float = Field(ge=0, description="s per token (linear layers, norms, MLP).")
    per_attn_pair: float = Field(default=0.0, ge=0, description="s per s^2 pair (1D attention).")
    per_spatial_pair: float = Field(default=0.0, ge=0, description="s per f*(hw)^2 pair (2D).")
    per_temporal_pair: float = Field(default=0.0, ge=0, description="s per hw*f^2 pair (2D).")
    per_sample: float = Field(default=0.0, ge=0, description="s per sample, not split by d.")


class ComputeCoefficients(_Frozen):
    """Compute-time coefficients."""

    forward: LayerTimeTerms = Field(description="One layer's forward.")
    backward: LayerTimeTerms = Field(description="One layer's backward (without recompute).")
    head_s_per_token: float = Field(
        default=0.0, ge=0, description="Embedding + output head + loss, forward+backward, per token."
    )
    microbatch_overhead_s: float = Field(
        default=0.0, ge=0, description="Fixed cost of one micro-batch (launches, loss, bookkeeping)."
    )


class ActivationCoefficients(_Frozen):
    """Activation-memory coefficients (bytes per token kept on a rank, before dividing by d)."""

    bytes_per_token_layer_none: float = Field(gt=0, description="Layer activations kept without checkpointing.")
    bytes_per_token_layer_full: float = Field(gt=0, description="Layer input kept under checkpointing.")
    working_bytes_per_token: float = Field(
        default=0.0, ge=0, description="Head/logits and communication buffers per token."
    )
    fixed_working_bytes: float = Field(
        default=0.0, ge=0, description="Per-rank working memory independent of the batch."
    )

    @model_validator(mode="after")
    def _check(self) -> ActivationCoefficients:
        if self.bytes_per_token_layer_full > self.bytes_per_token_layer_none:
            raise ValueError(
                f"bytes_per_token_layer_full={self.bytes_per_token_layer_full} exceeds "
                f"bytes_per_token_layer_none={self.bytes_per_token_layer_none}"
            )
        return self


class LinkFit(_Frozen):
    """Alpha-beta fit of one collective for one placement (and optionally one group size)."""

    placement: Literal["intra", "inter"] = Field(description="intra: inside a node; inter: across nodes.")
    group_size: int | None = Field(default=None, gt=1, description="Group size it was fitted for; None = any.")
    alpha_s: float = Field(ge=0, description="Latency per operation in seconds.")
    bytes_per_s: float = Field(gt=0, description="Bandwidth per rank in bytes per second.")


class CommCoefficients(_Frozen):
    """Communication coefficients."""

    alltoall_bytes_per_token_layer: float = Field(
        ge=0, description="Bytes each rank sends+keeps in a layer's forward all-to-alls, per token."
    )
    alltoall_ops_per_layer: int = Field(ge=0, description="All-to-all operations in a layer's forward.")
    alltoall: list[LinkFit] = Field(min_length=1, description="All-to-all alpha-beta fits.")
    allreduce: list[LinkFit] = Field(min_length=1, description="All-reduce alpha-beta fits.")
    grad_bytes_per_param: float = Field(default=2.0, gt=0, description="Gradient bytes per parameter.")

    def link(self, kind: Literal["alltoall", "allreduce"], *, placement: str, group_size: int) -> LinkFit:
        """The fit for this placement and group size: exact size first, then a size-free fit.

        Raises:
            ValueError: when no fit covers the placement.
        """
        fits = self.alltoall if kind == "alltoall" else self.allreduce
        exact = [f for f in fits if f.placement == placement and f.group_size == group_size]
        if exact:
            return exact[0]
        generic = [f for f in fits if f.placement == placement and f.group_size is None]
        if generic:
            return generic[0]
        same_placement = [f for f in fits if f.placement == placement and f.group_size is not None]
        if same_placement:  # nearest measured size
            return min(same_placement, key=lambda f: abs((f.group_size or 0) - group_size))
        raise ValueError(f"no {kind} fit for placement={placement!r} (group_size={group_size})")


class TermFit(_Frozen):
    """Held-out quality of one fitted term."""

    mape: float = Field(ge=0, description="Mean absolute percentage error on held-out points (0.03 = 3%).")
    num_points: int = Field(ge=0, description="Points used to fit.")
    num_heldout: int = Field(ge=0, description="Points held out to validate.")


class CostModelFile(_Frozen):
    """A versioned cost model: what the planner and the service load."""

    schema_version: int = Field(default=COST_MODEL_SCHEMA_VERSION, description="Wire schema version.")
    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$", description="Stable id.")
    provenance: Literal["analytic", "fitted"] = Field(description="Derived from specs, or fitted to a profile.")
    model: ModelSpec = Field(description="The model shape it is for.")
    hardware: str = Field(min_length=1, description="The accelerator kind it is for.")
    num_params: int = Field(gt=0, description="Parameters of the full model.")
    compute: ComputeCoefficients
    activation: ActivationCoefficients
    comm: CommCoefficients
    fit_quality: dict[str, TermFit] = Field(default_factory=dict, description="Per term, for fitted models.")
    notes: str = Field(default="", description="Provenance details (profile file, sources).")

    @model_validator(mode="after")
    def _check_version(self) -> CostModelFile:
        if self.schema_version != COST_MODEL_SCHEMA_VERSION:
            raise ValueError(
                f"schema_version={self.schema_version} is not supported "
                f"(expected {COST_MODEL_SCHEMA_VERSION})"
            )
        return self

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: identifies the exact coefficients."""
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        """Write the file as indented JSON."""
        Path(path).write_text(self.model_dump_json(indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModelFile:
        """Read and validate a cost-model file."""
        return cls.model_validate_json(Path(path).read_text())
