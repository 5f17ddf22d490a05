"""The profile file format ``dcp-profile/4``: versioned JSON Lines, one record per line.

A leaf module (pydantic only, no torch) so that profiles made anywhere (another cluster, another
framework) can be validated and fitted by ``costmodel.fit`` without torch.

Layout of a file:

1. the first line is a ``header`` record: the format version, what was profiled (the full
   ``model`` the cost model is for, and the ``profiled`` shape that actually ran, which may have
   fewer layers, a narrower width or a smaller vocabulary), the device, the dtype and the
   software versions;
2. then any number of measurement records, in any order:

   * ``compute``: forward+backward of a stack of ``num_layers`` layers on one packed micro-batch
     of ``samples`` (each ``[frames, tokens_per_frame]``; a 1D sample is ``[1, tokens]``), with
     ``recompute_layers`` of them checkpointed, as one rank of a sequence-parallel group of
     ``group_size`` runs it: the dense parts on its ``tokens_per_rank`` tokens, attention over
     every whole sample for ``1/group_size`` of the heads (the all-to-all replaced by a local
     copy, so only compute is timed). ``time_s`` is the median over ``num_repeats`` timed runs
     after warm-up, ``time_s_min`` / ``time_s_max`` the spread. ``activation_bytes`` is the exact
     size of what the forward keeps for backward (unique storages of the tensors saved by
     autograd, plus the inputs held by checkpointed layers; parameters excluded);
     ``device_kept_bytes`` / ``device_peak_bytes`` the bytes live after forward and at the peak
     of forward+backward above the start (the allocator on a GPU, live tensors on a CPU).
   * ``head``: forward+backward of what surrounds the layers (1D: embedding, final norm, output
     projection, cross-entropy loss; 2D: patch embedding, final projection, loss) on ``tokens``
     tokens, with its ``activation_bytes``.
   * ``comm``: one collective (``alltoall`` = ``all_to_all_single``, or ``allreduce``) on a group
     of ``group_size`` contiguous ranks spanning ``num_nodes`` nodes, each rank holding
     ``bytes_per_rank`` bytes; ``time_s`` is the median over repeats of the slowest rank.
     ``context`` says how it was measured: ``isolated`` (the default) back to back on its own
     (``dcp profile-comm``); ``in_layer`` as the training step exposes it: the model's
     forward+backward on the real group minus the same with the all-to-all replaced by a local
     copy (``EmulatedGroup``), per call, ``bytes_per_rank`` the mean input of a call; one
     figure, the fastest real run minus the fastest emulated one (the statistic a fit to the
     fastest repeats pairs with), so ``time_s = time_s_min = time_s_max``. A fit takes the
     latency of a group's all-to-all from its ``in_layer`` records where it has them.
     ``ring_step`` is one ring step as ring attention runs it: the hop of ``bytes_per_rank``
     (``p2p``) posted, a computation of ``compute_s`` alone run meanwhile, then the hop waited
     for; ``time_s`` the step, ``hop_s`` the hop alone and ``compute_s`` the computation alone,
     all three timed in the same rounds, so the share of the shorter one the overlap does not
     hide is measured (``costmodel.ring.fit``).
   * ``ring_attention``: one rank's attention of a sample of ``tokens`` as a ring of
     ``ring_degree`` runs it (``ulysses_degree`` x ``ring_degree`` group): ``ring_degree`` block
     steps of ``tokens / ring_degree`` queries against as many keys and values, for
     ``num_heads`` heads of ``head_dim``, with the log-sum-exp merge of the partial outputs,
     forward+backward, no communication (``time_s``); beside it ``ulysses_time_s``, the same
     rank's share of the pairs as one kernel over the whole sample (what the per-sample terms
     price), timed in the same rounds.

Times are seconds and sizes bytes throughout. Unknown fields are refused, so a typo never
passes silently. Version 1 files (no group sizes: every measurement was one whole rank) are read
as group size 1; version 2 files (no ``context``) as ``isolated`` collectives; version 3 files
(no ring steps, no ring attention) as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from costmodel.specs import ModelSpec

PROFILE_FORMAT: Literal["dcp-profile/4"] = "dcp-profile/4"
PROFILE_FORMATS = ("dcp-profile/1", "dcp-profile/2", "dcp-profile/3", PROFILE_FORMAT)
"""Formats this reader accepts; version 1 is upgraded (group size 1), versions 2 and 3 are read
as they are (their collectives are ``isolated``; they have no ring records)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Timed(_Record):
    time_s: float = Field(gt=0, description="Median time over the repeats, seconds.")
    time_s_min: float = Field(gt=0, description="Fastest repeat, seconds.")
    time_s_max: float = Field(gt=0, description="Slowest repeat, seconds.")
    num_repeats: int = Field(gt=0, description="Timed repeats after warm-up.")

    @model_validator(mode="after")
    def _check_spread(self) -> _Timed:
        if not self.time_s_min <= self.time_s <= self.time_s_max:
            raise ValueError(
                f"time_s={self.time_s} must lie between time_s_min={self.time_s_min} and "
                f"time_s_max={self.time_s_max}"
            )
        return self


class ProfileHeader(_Record):
    """First line of every profile file: what was run, where, with what."""

    record: Literal["header"] = "header"
    format: Literal["dcp-profile/1", "dcp-profile/2", "dcp-profile/3", "dcp-profile/4"] = Field(
        default=PROFILE_FORMAT, description="Format version.")
    hardware: str = Field(min_length=1, description="Accelerator kind the profile is for (e.g. h200-sxm).")
    device: Literal["cpu", "cuda"] = Field(description="torch device type that ran the profile.")
    device_name: str = Field(default="", description="Device name as reported by the runtime.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Activation/parameter dtype.")
    model: ModelSpec | None = Field(default=None, description="Full model the cost model is for.")
    profiled: ModelSpec | None = Field(
        default=None, description="Shape that actually ran (layers, width, vocabulary may be smaller)."
    )
    num_threads: int = Field(default=0, ge=0, description="CPU threads used by torch (0 = unknown).")
    timer: Literal["", "cuda_events", "perf_counter", "thread_time"] = Field(
        default="", description="How times were taken ('' = not stated)."
    )
    world_size: int = Field(default=1, gt=0, description="Ranks in a communication profile.")
    versions: dict[str, str] = Field(default_factory=dict, description="python, torch, dcp versions.")
    notes: str = Field(default="", description="Free text: command line, machine.")

    @model_validator(mode="after")
    def _check(self) -> ProfileHeader:
        if (self.model is None) != (self.profiled is None):
            raise ValueError("header: give both model and profiled, or neither (communication only)")
        if self.model is not None and self.profiled is not None:
            if self.model.kind != self.profiled.kind:
                raise ValueError(
                    f"header: profiled kind {self.profiled.kind!r} differs from model kind "
                    f"{self.model.kind!r}"
                )
            if self.profiled.num_layers > self.model.num_layers:
                raise ValueError(
                    f"header: profiled.num_layers={self.profiled.num_layers} exceeds "
                    f"model.num_layers={self.model.num_layers}"
                )
        return self

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the dtype."""
        return 4 if self.dtype == "float32" else 2


class ComputeRecord(_Timed):
    """Forward+backward of ``num_layers`` layers on one packed micro-batch."""

    record: Literal["compute"] = "compute"
    num_layers: int = Field(gt=0, description="Layers in the stack that ran.")
    recompute_layers: int = Field(ge=0, description="Layers of the stack run under checkpointing.")
    samples: list[tuple[int, int]] = Field(
        min_length=1, description="[frames, tokens_per_frame] per packed sample (1D: [1, tokens])."
    )
    activation_bytes: float = Field(ge=0, description="Exact bytes kept by the forward for backward.")
    group_size: int = Field(gt=0, description="SP group size whose one rank's share ran.")
    tokens_per_rank: int = Field(gt=0, description="Tokens the rank held (dense parts ran on these).")
    device_kept_bytes: float | None = Field(default=None, ge=0, description="Live bytes after forward.")
    device_peak_bytes: float | None = Field(default=None, ge=0, description="Peak live bytes in the step.")

    @model_validator(mode="after")
    def _check(self) -> ComputeRecord:
        if self.recompute_layers > self.num_layers:
            raise ValueError(
                f"recompute_layers={self.recompute_layers} exceeds num_layers={self.num_layers}"
            )
        for frames, spatial in self.samples:
            if frames <= 0 or spatial <= 0:
                raise ValueError(f"sample shape [{frames}, {spatial}] must be positive")
        total, d = self.num_tokens, self.group_size
        if not total // d <= self.tokens_per_rank <= -(-total // d) + len(self.samples):
            raise ValueError(
                f"tokens_per_rank={self.tokens_per_rank} is not a share of {total} tokens over "
                f"group_size={d}"
            )
        return self

    @property
    def num_tokens(self) -> int:
        """Tokens in the micro-batch."""
        return sum(f * hw for f, hw in self.samples)


class HeadRecord(_Timed):
    """Forward+backward of the parts around the layers on ``tokens`` tokens."""

    record: Literal["head"] = "head"
    tokens: int = Field(gt=0, description="Tokens in the micro-batch.")
    activation_bytes: float = Field(ge=0, description="Exact bytes kept by the forward for backward.")
    device_peak_bytes: float | None = Field(
        default=None, ge=0, description="Peak over forward+backward above the start (logits, their "
                                         "gradient and the loss's scratch); absent in older profiles.")


class CommRecord(_Timed):
    """One collective on a contiguous group of ranks."""

    record: Literal["comm"] = "comm"
    op: Literal["alltoall", "allreduce", "p2p", "ring_step"] = Field(
        description="all_to_all_single, all_reduce, p2p: one ring hop (each rank sends bytes_per_rank to "
                    "the next and receives as much from the previous, batch_isend_irecv; costmodel.ring), or "
                    "ring_step: that hop with a computation run while it is in flight.")
    group_size: int = Field(gt=1, description="Ranks in the group.")
    num_nodes: int = Field(gt=0, description="Nodes the group spans.")
    bytes_per_rank: float = Field(gt=0, description="Bytes each rank holds (input of the collective).")
    backend: str = Field(default="", description="gloo, nccl, ...")
    context: Literal["isolated", "in_layer"] = Field(
        default="isolated", description="isolated: back to back on its own; in_layer: the time a call "
                                         "adds to the model's layers on the real group (per call).")
    compute_s: float | None = Field(default=None, gt=0, description=(
        "ring_step only: median seconds of the computation alone, timed in the same rounds."))
    hop_s: float | None = Field(default=None, gt=0, description=(
        "ring_step only: median seconds of the hop alone, timed in the same rounds."))

    @model_validator(mode="after")
    def _check_ring_step(self) -> CommRecord:
        step = self.op == "ring_step"
        if step != (self.compute_s is not None) or step != (self.hop_s is not None):
            raise ValueError(f"op={self.op!r}: compute_s and hop_s are given with ring_step records and only "
                             f"with them (got compute_s={self.compute_s}, hop_s={self.hop_s})")
        return self

    @property
    def placement(self) -> Literal["intra", "inter"]:
        """intra when the group stays inside one node."""
        return "intra" if self.num_nodes == 1 else "inter"


class RingAttentionRecord(_Timed):
    """One rank's attention of one sample as ring steps on its blocks, and as one kernel."""

    record: Literal["ring_attention"] = "ring_attention"
    tokens: int = Field(gt=0, description="Tokens of the sample.")
    ulysses_degree: int = Field(default=1, gt=0, description="u: the Ulysses part of the group.")
    ring_degree: int = Field(gt=1, description="r: the ring's steps (blocks of tokens / r).")
    num_heads: int = Field(gt=0, description="Heads the rank attends (the model's over u).")
    head_dim: int = Field(gt=0, description="Head size.")
    causal: bool = Field(default=False, description="Whether the blocks were masked causally.")
    ulysses_time_s: float = Field(gt=0, description=(
        "Median seconds of the same pairs as one kernel over the whole sample, forward+backward (the "
        "share of a Ulysses rank of u*r: num_heads / r heads), timed in the same rounds."))

    @model_validator(mode="after")
    def _check_blocks(self) -> RingAttentionRecord:
        if self.tokens < self.ring_degree:
            raise ValueError(f"tokens={self.tokens} has fewer tokens than ring_degree={self.ring_degree} blocks")
        return self


MeasurementRecord = Annotated[ComputeRecord | HeadRecord | CommRecord | RingAttentionRecord,
                              Field(discriminator="record")]
_MEASUREMENT = TypeAdapter(MeasurementRecord)


class Profile(BaseModel):
    """A parsed profile: its header and its measurement records."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    header: ProfileHeader
    compute: list[ComputeRecord] = Field(default_factory=list)
    head: list[HeadRecord] = Field(default_factory=list)
    comm: list[CommRecord] = Field(default_factory=list)
    ring_attention: list[RingAttentionRecord] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if (self.compute or self.head) and self.header.profiled is None:
            raise ValueError("compute/head records need a header with model and profiled")
        if self.header.profiled is not None:
            for rec in self.compute:
                if rec.num_layers > self.header.profiled.num_layers:
                    raise ValueError(
                        f"compute record num_layers={rec.num_layers} exceeds "
                        f"profiled.num_layers={self.header.profiled.num_layers}"
                    )
                if self.header.profiled.kind == "1d" and any(f != 1 for f, _ in rec.samples):
                    raise ValueError(f"1D profile has a sample with frames != 1: {rec.samples}")
        return self


def narrowed(model: ModelSpec, *, num_layers: int, hidden: int | None = None, num_heads: int | None = None,
             ffn_hidden: int | None = None, vocab: int | None = None,
             cross_attention_tokens: int | None = None) -> ModelSpec:
    """The shape to profile: ``model`` with fewer layers and optionally a narrower width.

    Raises:
        ValueError: when the result is not a valid model (e.g. hidden not divisible by heads), or
            for a mixture-of-experts or sliding-window model (the profiling blocks are dense
            full-attention layers; such models use the analytic cost model).
    """
    if model.num_experts or model.num_sliding_layers:
        raise ValueError(f"model {model.name!r} has experts or sliding-window layers, which the profiling "
                         "blocks do not run (dense full-attention layers): plan it with its analytic cost model")
    if num_layers > model.num_layers:
        raise ValueError(f"num_layers={num_layers} exceeds the model's {model.num_layers}")
    heads = num_heads or model.num_heads
    kv = model.kv_heads
    if num_heads is not None:  # keep the GQA ratio
        kv = max(1, heads * model.kv_heads // model.num_heads)
    update = {
        "name": f"{model.name}-profiled", "num_layers": num_layers, "hidden": hidden or model.hidden,
        "num_heads": heads, "num_kv_heads": kv if model.num_kv_heads is not None else None,
        "ffn_hidden": ffn_hidden or model.ffn_hidden,
        "vocab": model.vocab if vocab is None else vocab,
        "cross_attention_tokens": (model.cross_attention_tokens if cross_attention_tokens is None
                                   else cross_attention_tokens),
        # a narrowed width has its own head size (the profiled blocks split hidden over the heads)
        "head_dim": model.head_dim if hidden is None and num_heads is None else None,
        "dual_stream_layers": min(model.dual_stream_layers, num_layers),
    }
    return ModelSpec.model_validate({**model.model_dump(), **update})


def dump_line(record: BaseModel) -> str:
    """One JSON line (no trailing newline) for a header or measurement record."""
    return json.dumps(record.model_dump(mode="json"), separators=(",", ":"))


def write_profile(path: str | Path, header: ProfileHeader, records: Iterable[BaseModel]) -> None:
    """Write a whole profile file (header first)."""
    lines = [dump_line(header), *(dump_line(r) for r in records)]
    Path(path).write_text("\n".join(lines) + "\n")


def parse_profile_lines(lines: Sequence[str], *, source: str = "<profile>") -> Profile:
    """Parse and validate the lines of a profile.

    Raises:
        ValueError: naming the source, the line number and the reason (missing or invalid field,
            unknown record kind, missing header).
    """
    body = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not body:
        raise ValueError(f"{source}: empty profile (expected a header line)")
    first_no, first = body[0]
    try:
        raw = json.loads(first)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}:{first_no}: not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("record") != "header":
        raise ValueError(f"{source}:{first_no}: the first record must be a header")
    version = raw.get("format", PROFILE_FORMAT)
    if version not in PROFILE_FORMATS:
        raise ValueError(f"{source}:{first_no}: format {version!r} is not one of {list(PROFILE_FORMATS)}")
    try:
        header = ProfileHeader.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{source}:{first_no}: invalid header: {_reason(exc)}") from None
    buckets: dict[str, list[BaseModel]] = {"compute": [], "head": [], "comm": [], "ring_attention": []}
    for no, line in body[1:]:
        try:
            data = json.loads(line)
            if version == "dcp-profile/1" and isinstance(data, dict) and data.get("record") == "compute":
                data = _upgrade_compute_v1(data)
            rec = _MEASUREMENT.validate_python(data)
            if version != PROFILE_FORMAT and _is_ring_record(rec):
                raise ValueError(f"{source}:{no}: {rec.record} records{' (ring_step)' if rec.record == 'comm' else ''}"
                                 f" are format {PROFILE_FORMAT}, not {version}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{no}: not JSON: {exc}") from None
        except ValidationError as exc:
            raise ValueError(f"{source}:{no}: invalid record ({version}): {_reason(exc)}") from None
        buckets[rec.record].append(rec)
    try:
        return Profile(header=header, **buckets)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ValueError(f"{source}: {_reason(exc)}") from None


def _is_ring_record(rec: BaseModel) -> bool:
    return isinstance(rec, RingAttentionRecord) or (isinstance(rec, CommRecord) and rec.op == "ring_step")


def _upgrade_compute_v1(data: dict[str, object]) -> dict[str, object]:
    """A ``dcp-profile/1`` compute record ran on one whole rank: group size 1."""
    samples = data.get("samples")
    tokens = 0
    if isinstance(samples, list):
        tokens = sum(int(f) * int(hw) for f, hw in samples
                     if isinstance(f, int) and isinstance(hw, int))
    return {**data, "group_size": 1, "tokens_per_rank": max(tokens, 1)}


def read_profile(path: str | Path) -> Profile:
    """Read and validate a profile file (see :func:`parse_profile_lines`)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"profile {str(p)!r} does not exist")
    return parse_profile_lines(p.read_text().splitlines(), source=str(p))


def _reason(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "<record>"
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})"[:300])
    return "; ".join(parts)
