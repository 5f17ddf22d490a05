"""Wire schemas for what the cost model is about: samples, models, hardware, clusters.

A leaf module (pydantic only): the planner, the service and the executor all import it.
Every model carries ``schema_version`` where it is stored on its own; validation errors
name the field and the offending value (pydantic's ``ValidationError`` is a ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1

LOSS_CHUNK_TOKENS_DEFAULT = 4096
"""Default ``ModelSpec.loss_chunk_tokens``: a 4,096-token chunk of a 128,256-word vocabulary
(Llama 3) holds 3.2 GB of bf16 logits and their fp32 copy, under 4% of an 80 GB GPU, while its
head GEMM (4,096 x hidden x vocab) stays far above the size where a GEMM runs at full rate
(a few hundred rows), so chunking costs only the recompute."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Sample(_Frozen):
    """One training sequence, identified by a stable dataset id.

    1D (text) samples give ``tokens``; 2D (video/image latent) samples give ``frames``,
    ``height`` and ``width`` in patches, and ``tokens`` is derived as ``f*h*w``.
    """

    id: str = Field(min_length=1, max_length=256, description="Stable id of the sample in its dataset.")
    tokens: int = Field(gt=0, description="Sequence length in tokens (f*h*w for 2D samples).")
    frames: int | None = Field(default=None, gt=0, description="Latent frames (2D only).")
    height: int | None = Field(default=None, gt=0, description="Latent height in patches (2D only).")
    width: int | None = Field(default=None, gt=0, description="Latent width in patches (2D only).")

    @model_validator(mode="before")
    @classmethod
    def _derive_tokens(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        dims = [data.get("frames"), data.get("height"), data.get("width")]
        given = [d is not None for d in dims]
        if any(given) and not all(given):
            raise ValueError(
                f"a 2D sample needs frames, height and width together; got frames={dims[0]}, "
                f"height={dims[1]}, width={dims[2]}"
            )
        if all(given):
            for name, value in zip(("frames", "height", "width"), dims, strict=True):
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            product = dims[0] * dims[1] * dims[2]  # type: ignore[operator]
            if data.get("tokens") is None:
                data = {**data, "tokens": product}
            elif data["tokens"] != product:
                raise ValueError(
                    f"tokens={data['tokens']} does not equal frames*height*width={product}"
                )
        return data

    @property
    def is_2d(self) -> bool:
        """True for a video/image latent sample."""
        return self.frames is not None

    @property
    def spatial_tokens(self) -> int:
        """Tokens per frame (``h*w``); the whole sequence for 1D samples."""
        if self.height is None or self.width is None:
            return self.tokens
        return self.height * self.width

    @property
    def num_frames(self) -> int:
        """Frames (1 for 1D samples)."""
        return self.frames if self.frames is not None else 1

    @property
    def shape_key(self) -> tuple[int, int]:
        """(frames, tokens per frame): samples with equal keys cost the same."""
        return (self.num_frames, self.spatial_tokens)


ModelKind = Literal["1d", "2d", "3d"]
"""1d: text decoder; 2d: spatial+temporal video DiT (Open-Sora 1.x); 3d: full-3D-attention video
DiT (one self-attention over all frames x height x width patch tokens of a clip per block, text by
cross-attention as in Wan 2.x or by joint attention as in MMDiT-style models)."""


LayerType = Literal["full_attention", "sliding_attention"]
"""A decoder layer's attention, as transformers' ``layer_types`` names it: causal over the whole
sample, or causal over the last ``sliding_window`` keys of each query."""


def _at_default(default: object) -> Callable[[object], bool]:
    """``exclude_if`` for a field added after the schema's first models: left out of a dump at
    its default, so a dense full-attention model serialises (and digests) as it did before."""
    return lambda value: value == default


SHAPE_FREE_FIELDS = frozenset({"name", "attention", "family"})
"""ModelSpec fields that name or describe a model without changing its shape (``ModelSpec.shape_differences``);
``family`` only chooses the analytic default's counted activation bytes, a cost-model file carries its own."""


class ModelSpec(_Frozen):
    """Public architecture numbers of a transformer (what the analytic cost model needs)."""

    name: str = Field(min_length=1, description="Preset or user name of the model.")
    kind: ModelKind = Field(description="1d: text decoder; 2d: spatial+temporal video DiT; "
                            "3d: full-3D-attention video DiT.")
    num_layers: int = Field(gt=0, description="Transformer layers (2D: spatial+temporal block pairs).")
    hidden: int = Field(gt=0, description="Hidden size.")
    num_heads: int = Field(gt=0, description="Query heads; Ulysses group sizes must divide it.")
    num_kv_heads: int | None = Field(default=None, gt=0, description="KV heads (GQA); default = num_heads.")
    head_dim: int | None = Field(default=None, gt=0,
                                 description="Per-head size; default hidden // num_heads.")
    ffn_hidden: int = Field(gt=0, description="MLP inner size.")
    vocab: int = Field(default=0, ge=0, description="Vocabulary size (1D only; 0 for video).")
    tied_embeddings: bool = Field(default=False, description="Input and output embeddings shared (1D).")
    causal: bool = Field(default=True, description="Causal self-attention (halves attention FLOPs).")
    mlp: Literal["swiglu", "gelu", "swiglu_clamped"] | None = Field(
        default=None, description="MLP kind; default swiglu for 1d, gelu for video; swiglu_clamped is "
        "gpt-oss' gated MLP (3 matrices as SwiGLU; clamped gate and up keep more values for backward)."
    )
    cross_attention_tokens: int = Field(
        default=0, ge=0, description="Text tokens each block cross-attends to (2D; 3D Wan style)."
    )
    joint_attention_tokens: int = Field(
        default=0, ge=0, description="Text tokens joined to each clip's self-attention (3D MMDiT style)."
    )
    dual_stream_layers: int = Field(
        default=0, ge=0, description="Joint-attention (MMDiT) layers whose text tokens have weights "
        "of their own (the first ones; the rest share one set, as HunyuanVideo's single-stream blocks).")
    patch_size: tuple[int, int, int] | None = Field(
        default=None, description="(t, h, w) patching of the latents (video); samples are in patches."
    )
    vae_stride: tuple[int, int, int] | None = Field(
        default=None, description="(t, h, w) compression of pixels into latents by the VAE (video)."
    )
    latent_channels: int | None = Field(default=None, gt=0, description="Latent channels (video).")
    attention: str | None = Field(default=None, description="Free-text note on the attention layout.")
    loss_chunk_tokens: int = Field(
        default=LOSS_CHUNK_TOKENS_DEFAULT, ge=0,
        description="Tokens per chunk of the LM loss (1D): each rank projects its tokens on the "
        "vocabulary and takes the cross-entropy this many at a time, recomputing each chunk in "
        "backward (executor/chunked_loss.py), so it never holds the whole logits; 0 materialises "
        "them whole. Ignored by video models (no vocabulary).")
    family: str | None = Field(
        default=None, description="Architecture family whose real layer classes the activation bytes were "
        "counted on (llama, qwen2, qwen3, mistral, wan, hunyuanvideo: costmodel/presets/"
        "activation_bytes.json); None: the generic formula of costmodel/model_terms.py.")
    num_experts: int = Field(
        default=0, ge=0, exclude_if=_at_default(0),
        description="Routed experts of each mixture-of-experts (MoE) layer; 0: a dense MLP in every layer.")
    num_experts_per_token: int = Field(
        default=0, ge=0, exclude_if=_at_default(0),
        description="Experts the router picks per token (top-k); at most num_experts.")
    expert_ffn_hidden: int | None = Field(
        default=None, gt=0, exclude_if=_at_default(None),
        description="Inner size of one expert's gated MLP (the model's mlp kind); needed with experts.")
    num_shared_experts: int = Field(
        default=0, ge=0, exclude_if=_at_default(0),
        description="Experts every token runs besides the routed ones (each expert_ffn_hidden wide).")
    dense_mlp_layers: tuple[int, ...] = Field(
        default=(), exclude_if=_at_default(()),
        description="0-based layers of an MoE model whose MLP is dense (ffn_hidden wide), as "
        "transformers' mlp_only_layers and decoder_sparse_step make them; the rest are MoE layers.")
    layer_types: tuple[LayerType, ...] | None = Field(
        default=None, exclude_if=_at_default(None),
        description="Each layer's attention (full_attention or sliding_attention), num_layers long; "
        "default: full attention everywhere.")
    sliding_window: int | None = Field(
        default=None, gt=0, exclude_if=_at_default(None),
        description="Keys a query of a sliding_attention layer sees (itself and the previous "
        "sliding_window - 1 tokens, as transformers' sliding-window causal mask).")
    attention_sinks: bool = Field(
        default=False, exclude_if=_at_default(False),
        description="A learned sink logit per query head joins every softmax (gpt-oss).")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        self._check_experts()
        self._check_layer_types()
        if self.head_dim is None and self.hidden % self.num_heads != 0:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads} "
                             "(give head_dim when the heads do not split the hidden size)")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.kind == "1d" and self.joint_attention_tokens:
            raise ValueError(f"joint_attention_tokens={self.joint_attention_tokens} is for video "
                             "models (kind 2d/3d), not kind '1d'")
        if self.dual_stream_layers > self.num_layers or (self.dual_stream_layers and not self.joint_attention_tokens):
            raise ValueError(f"dual_stream_layers={self.dual_stream_layers} needs joint_attention_tokens > 0 and "
                             f"at most num_layers={self.num_layers}")
        for name in ("patch_size", "vae_stride"):
            value = getattr(self, name)
            if value is not None and any(v <= 0 for v in value):
                raise ValueError(f"{name}={value} must be three positive integers")
        return self

    def _check_experts(self) -> None:
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(f"num_experts_per_token={self.num_experts_per_token} is above "
                             f"num_experts={self.num_experts}")
        if self.num_experts and (not self.num_experts_per_token or self.expert_ffn_hidden is None):
            raise ValueError(f"num_experts={self.num_experts} needs num_experts_per_token > 0 and "
                             f"expert_ffn_hidden (got {self.num_experts_per_token}, {self.expert_ffn_hidden})")
        if not self.num_experts and (self.num_shared_experts or self.dense_mlp_layers
                                     or self.expert_ffn_hidden is not None):
            raise ValueError("num_shared_experts, dense_mlp_layers and expert_ffn_hidden are for MoE "
                             "models: set num_experts > 0")
        if self.num_experts and self.kind != "1d":
            raise ValueError(f"num_experts={self.num_experts} is for text decoders (kind '1d'), "
                             f"not kind {self.kind!r}")
        bad = [i for i in self.dense_mlp_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.dense_mlp_layers)) != len(self.dense_mlp_layers):
            raise ValueError(f"dense_mlp_layers={list(self.dense_mlp_layers)} must be distinct layers "
                             f"in 0..{self.num_layers - 1}")

    def _check_layer_types(self) -> None:
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_layers="
                             f"{self.num_layers}")
        if self.num_sliding_layers and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.sliding_window is not None and not self.num_sliding_layers:
            raise ValueError(f"sliding_window={self.sliding_window} but no layer is sliding_attention "
                             "(give layer_types)")
        if (self.layer_types is not None or self.attention_sinks) and (self.kind != "1d" or not self.causal):
            raise ValueError("layer_types and attention_sinks are for causal text decoders (kind '1d')")

    @property
    def num_sliding_layers(self) -> int:
        """Layers whose attention is a sliding window (0 for full attention everywhere)."""
        return 0 if self.layer_types is None else self.layer_types.count("sliding_attention")

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for dense models)."""
        return self.num_layers - len(self.dense_mlp_layers) if self.num_experts else 0

    def shape_differences(self, other: ModelSpec) -> list[str]:
        """Where this model's shape differs from ``other``'s, one ``field a != b`` per field.

        A shape is every field but the name, the free-text ``attention`` note and the ``family``, with defaults
        filled in (``num_kv_heads``, ``head_dim`` and ``mlp`` left out equal their default), so a
        model read from a ``config.json`` in any folder matches the preset or the profile of the
        same architecture. Empty when the shapes are equal.
        """
        effective = {"num_kv_heads": "kv_heads", "head_dim": "head_size", "mlp": "mlp_kind"}
        out = []
        for name in type(self).model_fields:
            if name in SHAPE_FREE_FIELDS:
                continue
            attr = effective.get(name, name)
            mine, theirs = getattr(self, attr), getattr(other, attr)
            if mine != theirs:
                out.append(f"{name} {mine!r} != {theirs!r}")
        return out

    @property
    def mlp_kind(self) -> str:
        """The MLP kind with its default filled in."""
        if self.mlp is not None:
            return self.mlp
        return "swiglu" if self.kind == "1d" else "gelu"

    @property
    def kv_heads(self) -> int:
        """KV heads with the default filled in."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        """Per-head size with the default filled in."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.num_heads

    @property
    def is_video(self) -> bool:
        """True for the video kinds (samples are frames x height x width patches)."""
        return self.kind != "1d"

    def allowed_group_sizes(self, *, max_size: int) -> list[int]:
        """Ulysses SP sizes this model allows, up to ``max_size``.

        A size ``d`` must divide the query heads, and either divide the key/value heads (each
        rank gets whole KV heads) or be a multiple of them (past the KV heads each KV head is
        replicated over the ``d / kv_heads`` ranks whose query heads use it, as DeepSpeed
        Ulysses and USP do for GQA).
        """
        kv = self.kv_heads
        return [d for d in range(1, min(max_size, self.num_heads) + 1)
                if self.num_heads % d == 0 and (kv % d == 0 or d % kv == 0)]


class HardwareSpec(_Frozen):
    """Public accelerator specs."""

    name: str = Field(min_length=1, description="Preset or user name of the accelerator.")
    hbm_bytes: float = Field(gt=0, description="Device memory in bytes.")
    hbm_bandwidth_bytes_per_s: float = Field(gt=0, description="Device memory bandwidth.")
    bf16_dense_flops: float = Field(gt=0, description="Peak dense bf16 FLOP/s.")
    nvlink_bytes_per_s_per_direction: float = Field(gt=0, description="Intra-node link bandwidth per GPU.")
    network_bytes_per_s_per_gpu: float = Field(gt=0, description="Inter-node bandwidth per GPU.")


StateSharding = Literal["replicated", "zero1", "zero2", "zero3"]
GradSyncMode = Literal["allreduce", "ddp", "fsdp2"]

DDP_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""``DistributedDataParallel``'s default ``bucket_cap_mb=25`` in bytes."""


class ClusterSpec(_Frozen):
    """The world a plan is made for."""

    schema_version: int = Field(default=SCHEMA_VERSION, description="Wire schema version.")
    name: str = Field(min_length=1, description="Preset or user name of the cluster.")
    hardware: HardwareSpec = Field(description="The accelerator of every rank.")
    num_gpus: int = Field(gt=0, description="World size N.")
    gpus_per_node: int = Field(gt=0, description="GPUs per node G (NVLink inside, network across).")
    memory_cap_fraction: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Share of device memory a plan may use (a margin against allocator "
        "fragmentation and out-of-memory deadlocks; DCP used 0.65-0.7).",
    )
    state_sharding: StateSharding = Field(
        default="zero1",
        description="How model states are held: replicated (plain optimizer), zero1 (optimizer "
        "states sharded, e.g. ZeroRedundancyOptimizer); zero2/zero3 are refused until the executor "
        "shards gradients. With grad_sync=fsdp2 it must be zero1: FSDP2 shards the optimizer "
        "states itself (its parameter sharding comes from grad_sync).",
    )
    grad_sync: GradSyncMode = Field(
        default="allreduce",
        description="How the executor sums a step's gradients (executor/grad_sync.py): allreduce "
        "(AllReduceSync: one all-reduce of the whole gradients per step), ddp (DDPSync: DDP's "
        "bucketed all-reduce in the rank's last backward), fsdp2 (FSDP2Sync: fully_shard per layer "
        "and the root; one all-gather of the parameters and one reduce-scatter of the gradients "
        "per unit and step).",
    )
    ddp_bucket_bytes: int = Field(
        default=DDP_DEFAULT_BUCKET_BYTES,
        gt=0,
        description="DDP's bucket_cap_mb in bytes (grad_sync=ddp only). At DDP's default (25 MiB) "
        "the first bucket holds 1 MiB, as DDP does.",
    )
    ddp_gradient_as_bucket_view: bool = Field(
        default=False,
        description="DDP's gradient_as_bucket_view (grad_sync=ddp only): False (DDP's default) "
        "keeps the bucket buffers as a second copy of the gradients.",
    )

    expert_parallel_size: int = Field(
        default=1, gt=0, exclude_if=_at_default(1),
        description="Ranks one mixture-of-experts layer's experts are split over (expert "
        "parallelism, contiguous ranks): each holds num_experts / size of them and every MoE layer "
        "pass dispatches and combines its tokens by two all-to-alls over them. Costed by the "
        "planner, not run by the executor. 1: every rank holds every expert.")

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        if self.num_gpus % self.expert_parallel_size != 0:
            raise ValueError(f"expert_parallel_size={self.expert_parallel_size} does not divide "
                             f"num_gpus={self.num_gpus}")
        if self.num_gpus % self.gpus_per_node != 0:
            raise ValueError(
                f"num_gpus={self.num_gpus} is not a multiple of gpus_per_node={self.gpus_per_node}"
            )
        if self.grad_sync == "fsdp2" and self.state_sharding == "replicated":
            raise ValueError(
                "state_sharding='replicated' with grad_sync='fsdp2': FSDP2 shards the optimizer "
                "states itself; use state_sharding='zero1' (the default)"
            )
        if self.grad_sync != "ddp" and (self.ddp_bucket_bytes != DDP_DEFAULT_BUCKET_BYTES
                                        or self.ddp_gradient_as_bucket_view):
            raise ValueError(
                f"ddp_bucket_bytes={self.ddp_bucket_bytes} / ddp_gradient_as_bucket_view="
                f"{self.ddp_gradient_as_bucket_view} are DDP settings but grad_sync="
                f"{self.grad_sync!r}: set grad_sync='ddp' or leave them at their defaults"
            )
        return self

    @property
    def num_nodes(self) -> int:
        """Nodes in the cluster."""
        return self.num_gpus // self.gpus_per_node

    @property
    def memory_cap_bytes(self) -> float:
        """Bytes a rank may use under the cap."""
        return self.hardware.hbm_bytes * self.memory_cap_fraction
