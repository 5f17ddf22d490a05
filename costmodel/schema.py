"""The cost-model file: fitted or analytic coefficients of the functional forms of docs/cost-model.md.

A leaf module. One file describes one model shape on one accelerator kind; the cluster
(world size, nodes, sharding) is applied when the file is evaluated (``costmodel.evaluate``).

Functional forms, per transformer layer, per pass (forward or backward) and per *call* of the
layer on one rank of a group of ``d`` (``costmodel.evaluate`` is the one implementation):

* a call runs the layer on a set of samples (a micro-batch, or the part of it that shares a
  checkpoint flag at that layer); ``n = sum(s_i)/d`` are the call's tokens per rank;
* dense parts (GEMMs, norms, MLP): ``per_token * (n + linear_half_tokens)``: work over a
  Hockney efficiency ``n / (n + n_half)`` (half-performance length; Hockney & Jesshope 1988),
  which makes short calls run far below peak;
* attention of sample ``i``: ``pairs_i/d * (1 + attention_half_tokens / (s_i/d))`` times the
  pair coefficient, with ``pairs = s^2`` (1D, ``per_attn_pair``) or ``f*(hw)^2`` spatial and
  ``hw*f^2`` temporal (2D): the same efficiency curve over the sample's tokens per rank;
* ``per_sample`` per sample (not divided by ``d``) and ``per_call`` per call (launches);
* in groups of ``d >= 2`` only, ``per_token_relayout * n``: the Ulysses re-layout around attention
  (packing the all-to-all's send buffer, reordering what it received; the same bytes in a
  forward and a backward pass, so one fitted value serves both);
* a layer recomputed under checkpointing costs one more forward call;
* activation bytes per token per layer: ``none`` (all kept) or ``full`` (block input only),
  plus a transient working set per token of the micro-batch while a layer runs backward;
* collectives: ``alpha + wire_bytes / bytes_per_s`` per operation, one fit per placement, group
  size and node count (see :class:`LinkFit`), the same formula for fitting and evaluation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from costmodel.model_terms import KIND_TERMS
from costmodel.specs import ModelSpec

COST_MODEL_SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
"""Version 1 files (before efficiency curves and executor-true collectives) are upgraded on load."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class LayerTimeTerms(_Frozen):
    """Seconds per unit of each feature for one layer on one GPU."""

    per_token: float = Field(ge=0, description="s per token (linear layers, norms, MLP).")
    per_attn_pair: float = Field(default=0.0, ge=0, description="s per s^2 pair (1D attention).")
    per_spatial_pair: float = Field(default=0.0, ge=0, description="s per f*(hw)^2 pair (2D).")
    per_temporal_pair: float = Field(default=0.0, ge=0, description="s per hw*f^2 pair (2D).")
    per_sample: float = Field(default=0.0, ge=0, description="s per sample, not split by d.")
    per_call: float = Field(default=0.0, ge=0, description="s per call of the layer (launches, fixed work).")
    per_token_relayout: float = Field(
        default=0.0, ge=0,
        description="s per token per rank of the Ulysses re-layout around attention, in groups of 2 or more "
                    "only (packing the all-to-all's send buffer, reordering what it received).")


class EfficiencyCurve(_Frozen):
    """A kernel's achieved share of peak by its size (published or measured points), interpolated
    log-linearly in the size.

    Between two points the efficiency is linear in ``ln(size)``; above the largest point it stays
    at the last one (the plateau); below the smallest it continues the first segment's slope,
    never below ``efficiency[0] * size / tokens[0]`` (a kernel on fewer tokens than the smallest
    measured is taken to run at least as fast per token as proportionally scaled work).
    """

    tokens: list[float] = Field(min_length=1, description="Sizes (tokens or rows), increasing.")
    efficiency: list[float] = Field(min_length=1, description="Achieved share of peak at each size, in (0, 1].")
    source: str = Field(default="", description="Where the points come from.")

    @model_validator(mode="after")
    def _check(self) -> EfficiencyCurve:
        if len(self.tokens) != len(self.efficiency):
            raise ValueError(f"{len(self.tokens)} sizes but {len(self.efficiency)} efficiencies")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)) or self.tokens[0] <= 0:
            raise ValueError(f"sizes must be positive and increasing, got {self.tokens}")
        if any(not 0 < e <= 1 for e in self.efficiency):
            raise ValueError(f"efficiencies must be in (0, 1], got {self.efficiency}")
        return self

    @property
    def max_efficiency(self) -> float:
        """The best efficiency of the curve (what its kernel reaches on long inputs)."""
        return max(self.efficiency)

    def at(self, size: object) -> np.ndarray:
        """Efficiency at ``size`` (scalar or array), interpolated as the class says.

        Raises:
            ValueError: for a size that is not positive.
        """
        n = np.asarray(size, dtype=np.float64)
        if (n <= 0).any():
            raise ValueError(f"kernel sizes must be positive, got {size!r}")
        logs, eff = np.log(np.asarray(self.tokens)), np.asarray(self.efficiency)
        out = np.interp(np.log(n), logs, eff)
        if len(logs) > 1:
            slope = (eff[1] - eff[0]) / (logs[1] - logs[0])
            below = eff[0] + slope * (np.log(n) - logs[0])
            floor = eff[0] * n / self.tokens[0]
            out = np.where(n < self.tokens[0], np.maximum(below, floor), out)
        else:
            out = np.where(n < self.tokens[0], eff[0] * n / self.tokens[0], out)
        return np.asarray(out, dtype=np.float64)

    def time_multiplier(self, size: object) -> np.ndarray:
        """Time of the kernel at ``size`` over its time at :attr:`max_efficiency`:
        ``max_efficiency / at(size)`` (1 on the plateau, larger for short inputs)."""
        return np.asarray(self.max_efficiency / self.at(size), dtype=np.float64)


class AttentionEfficiency(_Frozen):
    """Efficiency curves of the attention kernel over the sequence length it runs on (the whole
    sample under Ulysses, one block under a ring step), one per pass. With them the pair
    coefficients hold the time per pair at each curve's best efficiency."""

    forward: EfficiencyCurve = Field(description="Forward kernel.")
    backward: EfficiencyCurve = Field(description="Backward kernel.")


class ComputeCoefficients(_Frozen):
    """Compute-time coefficients."""

    forward: LayerTimeTerms = Field(description="One layer's forward.")
    backward: LayerTimeTerms = Field(description="One layer's backward (without recompute).")
    head_s_per_token: float = Field(
        default=0.0, ge=0, description="Embedding + output head + loss, forward+backward, per token."
    )
    microbatch_overhead_s: float = Field(
        default=0.0, ge=0, description="Fixed cost of one micro-batch outside the layers (loss, bookkeeping)."
    )
    linear_half_tokens: float = Field(
        default=0.0, ge=0,
        description="Half-performance length of the dense parts over a call's tokens per rank.",
    )
    attention_half_tokens: float = Field(
        default=0.0, ge=0,
        description="Half-performance length of attention over a sample's tokens per rank.",
    )
    attention_efficiency: AttentionEfficiency | None = Field(
        default=None,
        description="Attention's efficiency by the sequence length its kernel runs on (replaces "
                    "attention_half_tokens where given; the analytic default from published kernel "
                    "throughput, costmodel.kernel_efficiency). Left out of the JSON when None.")

    @model_serializer(mode="wrap")
    def _omit_default_curve(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data: dict[str, object] = handler(self)
        if self.attention_efficiency is None:
            data.pop("attention_efficiency", None)
        return data


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
    transient_bytes_per_token: float = Field(
        default=0.0, ge=0,
        description="Working set of one layer's backward per token per rank of the micro-batch.",
    )
    head_transient_bytes_per_token: float = Field(
        default=0.0, ge=0,
        description="Working set of the head's and loss's backward per token beyond what the head "
                    "saves (the logits' gradient, softmax scratch); it runs before the layers' "
                    "backward, so the larger of it and a layer's transient counts.",
    )
    fixed_working_bytes_per_layer: float = Field(
        default=0.0, ge=0,
        description="Working memory of a micro-batch per layer of the model, whatever its tokens "
                    "(e.g. weight-gradient buffers of the backward); fitted from peaks.",
    )
    loss_chunk_bytes: float = Field(
        default=0.0, ge=0,
        description="Bytes the chunked LM loss holds per rank at its peak whatever the tokens: one "
                    "chunk of logits and their fp32 copy (ModelSpec.loss_chunk_tokens; 0 with whole "
                    "logits, which working_bytes_per_token counts per token instead).",
    )
    alltoall_buffer_bytes_per_token: float = Field(
        default=0.0, ge=0,
        description="Ulysses all-to-all send and receive buffers per token per rank while a layer's "
                    "attention runs; charged only in groups whose Ulysses degree is above 1 (a rank "
                    "alone sends nothing). Files without it count them in working_bytes_per_token.",
    )
    bytes_per_sample_layer_none: float = Field(
        default=0.0, ge=0,
        description="Bytes one layer kept without checkpointing holds per sample whatever its tokens "
                    "(cross-attention keys and values of the sample's text), on every rank of its group.",
    )
    kv_head_bytes_per_token_layer: float = Field(
        default=0.0, ge=0,
        description="Bytes one key/value head's k and v add per token per layer kept without "
                    "checkpointing, for each head of replication in a group larger than the KV heads "
                    "(each rank keeps the head of its query heads for the whole sequence).",
    )
    recomputed_layer_bytes_per_token: float | None = Field(
        default=None, ge=0,
        description="Bytes per token per rank one recomputed layer holds while its backward runs (its "
                    "rematerialised activations with their working set): a checkpointed sample peaks at "
                    "k*full + max((L-k)*none + transient, this). None: none + transient, the "
                    "rematerialised layer on top of the transient (the analytic form). Fitted from peaks; "
                    "left out of the JSON when None.",
    )
    memory_margin_fraction: float = Field(
        default=0.0, ge=0,
        description="Held-out under-prediction of a forced memory fit (0.2 = peaks up to 20% above the "
                    "prediction): the planner keeps the larger of its memory_safety_fraction and "
                    "margin / (1 + margin) of the activation budget free, never both. Left out of the "
                    "JSON when 0.",
    )

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # No return annotation: pydantic keeps the model's own serialization schema. Files without
        # the fitted peak form or a margin keep their bytes and digests.
        data: dict[str, object] = handler(self)
        if self.recomputed_layer_bytes_per_token is None:
            data.pop("recomputed_layer_bytes_per_token", None)
        if self.memory_margin_fraction == 0.0:
            data.pop("memory_margin_fraction", None)
        return data

    @model_validator(mode="after")
    def _check(self) -> ActivationCoefficients:
        if self.bytes_per_token_layer_full > self.bytes_per_token_layer_none:
            raise ValueError(
                f"bytes_per_token_layer_full={self.bytes_per_token_layer_full} exceeds "
                f"bytes_per_token_layer_none={self.bytes_per_token_layer_none}"
            )
        return self


class LinkFit(_Frozen):
    """Alpha-beta fit of one collective for one placement, optionally one group size and node count.

    Time of one operation ``= alpha_s * latency_steps + wire_bytes / bytes_per_s`` where
    ``wire_bytes`` is what each rank sends (``costmodel.evaluate.wire_bytes``) and
    ``latency_steps`` is 1 for an all-to-all and ``2*(d-1)`` for a ring all-reduce. A fit with a
    ``group_size`` (and ``num_nodes``) holds the *effective* bandwidth of exactly that
    configuration (what was measured). A fit without one is a raw per-GPU link: inside a node the
    NVLink share, across nodes the network, combined by the node split of the group.
    """

    placement: Literal["intra", "inter"] = Field(description="intra: inside a node; inter: across nodes.")
    group_size: int | None = Field(default=None, gt=1, description="Group size it was fitted for; None = raw link.")
    num_nodes: int | None = Field(default=None, gt=0, description="Nodes the fitted group spanned; None = any.")
    alpha_s: float = Field(ge=0, description="Latency per operation (per ring step for all-reduce), seconds.")
    bytes_per_s: float = Field(gt=0, description="Bandwidth per rank in bytes per second.")


class P2PLinks(_Frozen):
    """Point-to-point links of a ring hop: one inside a node, one across nodes
    (``LinkFit``s with ``group_size`` 2: a hop is one rank sending to the next). A hop of ``b``
    bytes takes ``alpha_s + b / bytes_per_s`` (``costmodel.ring.timing.p2p_time_s``)."""

    intra: LinkFit = Field(description="A hop between two GPUs of one node.")
    inter: LinkFit | None = Field(default=None, description="A hop between nodes (None: not measured).")

    def link(self, *, crosses_nodes: bool) -> LinkFit:
        """The link of a hop.

        Raises:
            ValueError: for a hop across nodes without an inter-node link.
        """
        if not crosses_nodes:
            return self.intra
        if self.inter is None:
            raise ValueError("a ring across nodes needs an inter-node p2p link; profile it "
                             "(dcp profile-comm --ops p2p on two nodes, or --gpus-per-node to emulate)")
        return self.inter


class RingCoefficients(_Frozen):
    """How a ring of ``r`` runs its steps (docs/cost-model.md cites the defaults).

    One ring step on one rank: the attention of its block at the block's efficiency ``c`` and the
    p2p hop of the next block ``h`` (``alpha + bytes / bandwidth``), posted together; the step
    takes ``max(c, h) + exposed_fraction * min(c, h) + step_overhead_s``. After the steps, one
    log-sum-exp merge of the running output per step but the first, at the HBM bandwidth
    (``merge_bytes_per_channel`` per query and head channel).
    """

    exposed_fraction: float = Field(
        default=0.37, ge=0, le=1,
        description="Share of the shorter of a step's attention and its hop that the overlap does not "
                    "hide (0: perfect overlap, 1: one after the other); fitted from p2p records timed "
                    "with and without concurrent compute.")
    step_overhead_s: float = Field(
        default=10e-6, ge=0,
        description="Fixed seconds per ring step: the kernel launches, the p2p's post and wait, the "
                    "synchronisation between the compute and the communication streams.")
    block_half_tokens: float = Field(
        default=0.0, ge=0,
        description="Extra half-performance length of a ring step's attention over its block's tokens "
                    "per sample (s/r), on top of the file's attention efficiency; 0 where the file has "
                    "an attention efficiency curve (the curve is read at the block's length); fitted "
                    "from compute records that carry a ring degree.")
    merge_bytes_per_channel: float = Field(
        default=12.0, gt=0,
        description="HBM bytes of one log-sum-exp merge per query and head channel (read the running "
                    "fp32 output and the block's, write the result).")
    source: str = Field(default="", description="Where the values come from (defaults, or the profile fitted).")


class CommCoefficients(_Frozen):
    """Communication coefficients."""

    alltoall_bytes_per_token_layer: float = Field(
        ge=0, description="Bytes each rank holds, per token, in one pass of a layer's all-to-alls."
    )
    alltoall_ops_per_layer: int = Field(
        ge=0, description="All-to-all operations per call of a layer per pass (executor: 2 per attention)."
    )
    alltoall_kv_head_bytes_per_token_layer: float = Field(
        default=0.0, ge=0,
        description="Bytes one key/value head's k and v add per token to a pass of a layer's "
                    "all-to-alls, for each head of replication in a group larger than the KV heads "
                    "(each token's k and v go to d ranks instead of kv_heads).",
    )
    alltoall: list[LinkFit] = Field(min_length=1, description="All-to-all alpha-beta fits.")
    allreduce: list[LinkFit] = Field(min_length=1, description="All-reduce alpha-beta fits.")
    grad_bytes_per_param: float = Field(default=2.0, gt=0, description="Gradient bytes per parameter.")
    p2p: P2PLinks | None = Field(default=None, description=(
        "Point-to-point links of ring attention's key/value hops (fitted by dcp fit from p2p records "
        "of dcp profile-comm --ops p2p). None: the cluster hardware's analytic links "
        "(costmodel.ring.timing.default_p2p_links). Left out of the JSON when None, so files without "
        "it keep their bytes and digests."))
    ring: RingCoefficients | None = Field(default=None, description=(
        "How ring steps run (exposed share of a hop, per-step cost, block efficiency, merges), fitted "
        "by dcp fit from ring records of dcp profile-comm and dcp profile. None: the published "
        "defaults (RingCoefficients()). Left out of the JSON when None."))

    @model_serializer(mode="wrap")
    def _omit_default_p2p(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # No return annotation: pydantic then keeps the model's own serialization schema
        data: dict[str, object] = handler(self)
        if self.p2p is None:
            data.pop("p2p", None)
        if self.ring is None:
            data.pop("ring", None)
        return data

    def fits_for(self, kind: Literal["alltoall", "allreduce"]) -> list[LinkFit]:
        """The fits of one collective."""
        return self.alltoall if kind == "alltoall" else self.allreduce

    def exact_link(self, kind: Literal["alltoall", "allreduce"], *, group_size: int, num_nodes: int
                   ) -> LinkFit | None:
        """The fit measured for exactly this group size and node count, if any."""
        placement = "intra" if num_nodes == 1 else "inter"
        for f in self.fits_for(kind):
            if (f.placement == placement and f.group_size == group_size
                    and f.num_nodes in (None, num_nodes)):
                return f
        return None

    def link(self, kind: Literal["alltoall", "allreduce"], *, placement: str, group_size: int) -> LinkFit:
        """The fit for this placement and group size: exact size first, then a raw link, then the
        nearest measured size.

        Raises:
            ValueError: when no fit covers the placement.
        """
        fits = self.fits_for(kind)
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
    id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+(@[0-9]{1,9})?$",
                    description="Stable id; ``base@rev`` names revision ``rev`` of a recalibrated model.")
    provenance: Literal["analytic", "fitted"] = Field(description="Derived from specs, or fitted to a profile.")
    model: ModelSpec = Field(description="The model shape it is for.")
    hardware: str = Field(min_length=1, description="The accelerator kind it is for.")
    num_params: int = Field(gt=0, description="Parameters of the full model.")
    compute: ComputeCoefficients
    activation: ActivationCoefficients
    comm: CommCoefficients
    fit_quality: dict[str, TermFit] = Field(default_factory=dict, description="Per term, for fitted models.")
    notes: str = Field(default="", description="Provenance details (profile file, sources).")

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: object) -> object:
        """Read version 1: the same coefficients, with the executor's all-to-all count per layer
        (2 per attention: q, k, v fused in, output back) instead of 4, and no efficiency curve."""
        if not isinstance(data, dict):
            return data
        version = data.get("schema_version", COST_MODEL_SCHEMA_VERSION)
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise ValueError(
                f"schema_version={version!r} is not supported (expected one of "
                f"{list(SUPPORTED_SCHEMA_VERSIONS)})"
            )
        if version == 1:
            model = data.get("model") or {}
            kind = model.get("kind") if isinstance(model, dict) else getattr(model, "kind", None)
            comm = dict(data.get("comm") or {})
            row = KIND_TERMS.get(str(kind))  # 2 all-to-alls per attention the kind's layer runs
            comm["alltoall_ops_per_layer"] = 2 * (row.attentions_per_layer if row else 1)
            notes = str(data.get("notes", ""))
            data = {**data, "schema_version": COST_MODEL_SCHEMA_VERSION, "comm": comm,
                    "notes": (notes + "; " if notes else "") + "upgraded from schema_version 1"}
        return data

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
