"""The analytic default cost model, derived from public model and accelerator specs.

Every coefficient comes from a formula written out below with its source, so that the
whole system runs (and plans sensibly) before anyone profiles a GPU. The profiling stage
(``costmodel.fit``) produces files of the same schema from measurements.

Sources:
  [K22] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
        Models", 2022, Sec. 4.1 (activation bytes per layer), adapted: flash attention keeps
        no s^2 scores, no dropout masks, SwiGLU or GELU MLP, bf16 activations.
  [N21] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
        Using Megatron-LM", 2021, App. (2 FLOPs per MAC; backward = 2x forward for matmuls).
  [D23] Dao, "FlashAttention-2", 2023 (attention: 4*s^2*h forward FLOPs, halved when causal;
        backward 2.5x forward).
  [R20] Rajbhandari et al., "ZeRO", 2020 (mixed-precision Adam: 2+2+12 bytes per parameter).
  [J23] Jacobs et al., "DeepSpeed Ulysses", 2023 (all-to-alls around attention: q, k, v in,
        output back; the same again in backward). Our executor fuses q, k and v into one
        all-to-all: 2 operations per attention per pass.
  [H88] Hockney & Jesshope, "Parallel Computers 2", 1988 (half-performance length n_1/2: a
        pipeline reaches half its peak rate at n_1/2 elements; time = (n + n_1/2) / peak).
  [W09] Williams, Waterman & Patterson, "Roofline", CACM 2009. A GEMM of n tokens against a
        bf16 weight matrix does 2*n FLOPs per weight and reads 2 bytes per weight: it is
        memory-bound below n = peak FLOP/s / memory bandwidth (H100 SXM 295, H200 206, A100 156
        tokens at spec numbers); compute time plus weight-read time is exactly the Hockney form
        with n_1/2 = achieved FLOP/s / achieved bandwidth.
  [D23b] FlashAttention-2 paper, Fig. 4-7 (A100, head dim 128, 16k tokens per batch): forward +
        backward throughput rises from ~110 TFLOP/s at 512 tokens per sequence to ~190 at 16k; a
        Hockney curve through those points has n_1/2 of about 400 tokens (non-causal) and more
        for causal; FlashAttention-3 (Shah et al. 2024, H100) shows the same shape. We take 512.
  [NV] NVIDIA CUDA best-practices guide: kernel launch latency of a few microseconds; every
        kernel of a layer costs at least that, which dominates layers on few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.schema import (
    ActivationCoefficients,
    CommCoefficients,
    ComputeCoefficients,
    CostModelFile,
    LayerTimeTerms,
    LinkFit,
)
from costmodel.specs import HardwareSpec, ModelSpec

BF16_BYTES = 2
FP32_BYTES = 4


@dataclass(kw_only=True, frozen=True, slots=True)
class AnalyticConfig:
    """Efficiency assumptions of the analytic model."""

    linear_flops_efficiency: float = 0.6
    """Achieved share of peak bf16 FLOP/s in the dense (GEMM) parts."""
    attention_flops_efficiency: float = 0.5
    """Achieved share of peak in flash attention."""
    attention_bwd_over_fwd: float = 2.5
    """Flash-attention backward FLOPs over forward [D23]."""
    nvlink_efficiency: float = 0.7
    """Achieved share of NVLink bandwidth in all-to-all and all-reduce."""
    network_efficiency: float = 0.8
    """Achieved share of the per-GPU network bandwidth."""
    intra_alpha_s: float = 10e-6
    """Latency of one collective inside a node."""
    inter_alpha_s: float = 30e-6
    """Latency of one collective across nodes."""
    min_kernel_s: float = 5e-6
    """Floor of one kernel's launch and run [NV]."""
    kernels_per_layer_forward_1d: int = 14
    """Kernels in one forward call of a 1D layer (norms, QKV, rotary, attention, output, MLP, adds);
    backward runs twice as many."""
    kernels_per_layer_forward_2d: int = 48
    """Kernels in one forward call of a 2D layer (two blocks with modulation, cross-attention, MLP)."""
    hbm_efficiency: float = 0.8
    """Achieved share of the memory bandwidth (sets the dense parts' half-performance length [W09])."""
    attention_half_tokens: float = 512.0
    """Half-performance length of attention over a sample's tokens per rank [D23b]."""
    microbatch_fixed_s: float = 1e-3
    """Fixed time per micro-batch outside the layers (data, loss, bookkeeping)."""
    fixed_working_bytes: float = 2e9
    """Allocator slack, NCCL buffers and workspaces per rank."""
    extra: dict[str, float] = field(default_factory=dict)
    """Free-form overrides recorded in the notes."""

    def __post_init__(self) -> None:
        for name in ("linear_flops_efficiency", "attention_flops_efficiency", "nvlink_efficiency",
                     "network_efficiency", "hbm_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")


def num_params(model: ModelSpec) -> int:
    """Parameters of the model (weights of linear layers, norms, embeddings).

    1D (LLaMA): per layer ``h*(h + 2*h_kv) + h*h`` (attention) + ``3*h*f`` (SwiGLU) + ``2*h``
    (norms); plus input and output embeddings ``2*V*h`` (untied).
    2D (STDiT): per block self-attention ``4*h^2``, cross-attention ``4*h^2``, MLP ``2*h*f``;
    two blocks (spatial, temporal) per layer.
    """
    h, f = model.hidden, model.ffn_hidden
    if model.kind == "1d":
        h_kv = h * model.kv_heads // model.num_heads
        per_layer = h * (h + 2 * h_kv) + h * h + 3 * h * f + 2 * h
        return model.num_layers * per_layer + 2 * model.vocab * h + h
    per_block = 4 * h * h + 4 * h * h + 2 * h * f + 6 * h
    return model.num_layers * 2 * per_block


def linear_flops_per_token_layer(model: ModelSpec) -> float:
    """Forward FLOPs per token per layer of the dense parts [N21: 2 FLOPs per MAC]."""
    h, f = model.hidden, model.ffn_hidden
    if model.kind == "1d":
        h_kv = h * model.kv_heads // model.num_heads
        mlp_macs = 3 * h * f if model.mlp_kind == "swiglu" else 2 * h * f
        return 2.0 * (h * (h + 2 * h_kv) + h * h + mlp_macs)
    # 2D layer = spatial block + temporal block, each: self-attn qkvo 4h^2, cross-attn q,o 2h^2,
    # MLP 2hf MACs, plus cross-attention scores against the text tokens (2*T*h MACs per token).
    mlp_macs = 3 * h * f if model.mlp_kind == "swiglu" else 2 * h * f
    per_block = 4 * h * h + 2 * h * h + mlp_macs + 2 * model.cross_attention_tokens * h
    return 2.0 * 2 * per_block


def attention_flops_per_pair(model: ModelSpec) -> float:
    """Forward attention FLOPs per (query, key) pair per layer: ``4*h``, half when causal [D23]."""
    return (2.0 if model.causal else 4.0) * model.hidden


def activation_bytes_per_token_layer(model: ModelSpec) -> tuple[float, float]:
    """(none, full) activation bytes per token per layer [K22, adapted].

    1D none: attention keeps norm input 2h, QKV input 2h, q 2h, k and v 2*h_kv each, output 2h
    (``8h + 4h_kv``), softmax log-sum-exp ``4*heads``; the SwiGLU MLP keeps norm input 2h,
    input 2h, gate, up, activation and product 2f each (``4h + 8f``).
    2D none per block: self-attention ``12h`` as above, cross-attention (q input, q, output)
    ``6h``, MLP ``4h + 4f`` (GELU: fc1 output and activation), adaLN modulations ``4h``;
    two blocks per layer.
    full: only the layer input, ``2h`` [K22 Sec. 5].
    """
    h, f = model.hidden, model.ffn_hidden
    h_kv = h * model.kv_heads // model.num_heads
    lse = FP32_BYTES * model.num_heads
    if model.kind == "1d":
        attn = BF16_BYTES * (4 * h + 2 * h_kv) + lse
        mlp = BF16_BYTES * (2 * h + (4 * f if model.mlp_kind == "swiglu" else 2 * f))
        none = attn + mlp
    else:
        attn = BF16_BYTES * (4 * h + 2 * h_kv) + lse
        cross = BF16_BYTES * 3 * h + lse
        mlp = BF16_BYTES * (2 * h + (4 * f if model.mlp_kind == "swiglu" else 2 * f))
        modulate = BF16_BYTES * 2 * h
        none = 2 * (attn + cross + mlp + modulate)
    full = float(BF16_BYTES * h)
    return float(none), full


def transient_bytes_per_token(model: ModelSpec) -> float:
    """Working set per token while one layer runs backward, beyond the kept activations.

    The gradients of the layer's largest intermediates live at once: 1D SwiGLU gate, up and
    product gradients ``3*2f`` and the fp32 q, k, v gradient accumulators of flash attention
    ``4*(h + 2*h_kv)``; 2D GELU ``2*2f`` and the same attention accumulators.
    """
    h, f = model.hidden, model.ffn_hidden
    h_kv = h * model.kv_heads // model.num_heads
    mlp = BF16_BYTES * (3 if model.mlp_kind == "swiglu" else 2) * f
    return float(mlp + FP32_BYTES * (h + 2 * h_kv))


def working_bytes_per_token(model: ModelSpec) -> float:
    """Per-token buffers outside the layers.

    1D: bf16 logits and their fp32 copy for the loss (``6*V`` bytes); Ulysses send and receive
    buffers for q, k, v (``2 * 3 * 2h``). 2D: the same communication buffers and the final
    layer's input and output.
    """
    h = model.hidden
    comm = 2.0 * 3 * BF16_BYTES * h
    if model.kind == "1d":
        return (BF16_BYTES + FP32_BYTES) * model.vocab + comm
    return comm + 2.0 * BF16_BYTES * h


def alltoall_bytes_per_token_layer(model: ModelSpec, *, dtype_bytes: int = BF16_BYTES) -> tuple[float, int]:
    """(bytes per token, operations) of one pass of a layer's all-to-alls, as the executor runs them.

    Each attention moves q, k, v in one fused operation (``h + 2*h_kv`` values per token) and
    the output back in another (``h``): ``2h + 2*h_kv`` values per token in 2 operations
    [J23]; a 2D layer has two self-attentions (spatial and temporal). Backward runs the same
    operations reversed, a recompute runs them again.
    """
    h = model.hidden
    h_kv = h * model.kv_heads // model.num_heads
    per_attention = dtype_bytes * (2 * h + 2 * h_kv)
    attentions = 1 if model.kind == "1d" else 2
    return float(per_attention * attentions), 2 * attentions


def linear_half_tokens(hardware: HardwareSpec, config: AnalyticConfig) -> float:
    """Half-performance length of the dense parts: achieved FLOP/s over achieved bytes/s [W09]."""
    flops = hardware.bf16_dense_flops * config.linear_flops_efficiency
    return flops / (hardware.hbm_bandwidth_bytes_per_s * config.hbm_efficiency)


def analytic_cost_model(
    model: ModelSpec, hardware: HardwareSpec, *, config: AnalyticConfig | None = None
) -> CostModelFile:
    """Derive the default cost model of ``model`` on ``hardware`` from their specs.

    Args:
        model: The transformer's architecture numbers.
        hardware: The accelerator's public specs.
        config: Efficiency assumptions; defaults to ``AnalyticConfig()``.

    Returns:
        A ``CostModelFile`` with provenance ``analytic`` and id ``analytic-<model>-<hardware>``.
    """
    cfg = config or AnalyticConfig()
    linear_rate = hardware.bf16_dense_flops * cfg.linear_flops_efficiency
    attn_rate = hardware.bf16_dense_flops * cfg.attention_flops_efficiency
    per_token_fwd = linear_flops_per_token_layer(model) / linear_rate
    per_pair_fwd = attention_flops_per_pair(model) / attn_rate
    per_sample_fwd = 0.0
    if model.kind == "2d" and model.cross_attention_tokens:
        # K and V projections of the text tokens in both blocks: 2 * (2*T*h*h) MACs.
        per_sample_fwd = 2 * 2.0 * 2 * model.cross_attention_tokens * model.hidden**2 / linear_rate
    kernels = cfg.kernels_per_layer_forward_1d if model.kind == "1d" else cfg.kernels_per_layer_forward_2d
    call_fwd = kernels * cfg.min_kernel_s
    if model.kind == "1d":
        fwd = LayerTimeTerms(per_token=per_token_fwd, per_attn_pair=per_pair_fwd, per_sample=per_sample_fwd,
                             per_call=call_fwd)
        bwd = LayerTimeTerms(
            per_token=2 * per_token_fwd,
            per_attn_pair=cfg.attention_bwd_over_fwd * per_pair_fwd,
            per_sample=2 * per_sample_fwd,
            per_call=2 * call_fwd,
        )
        # Embedding lookup is free; output head 2*h*V FLOPs forward, 2x backward [N21].
        head_flops = 3 * 2.0 * model.hidden * model.vocab
    else:
        fwd = LayerTimeTerms(
            per_token=per_token_fwd,
            per_spatial_pair=per_pair_fwd,
            per_temporal_pair=per_pair_fwd,
            per_sample=per_sample_fwd,
            per_call=call_fwd,
        )
        bwd = LayerTimeTerms(
            per_token=2 * per_token_fwd,
            per_spatial_pair=cfg.attention_bwd_over_fwd * per_pair_fwd,
            per_temporal_pair=cfg.attention_bwd_over_fwd * per_pair_fwd,
            per_sample=2 * per_sample_fwd,
            per_call=2 * call_fwd,
        )
        # Patch embedding in and final projection out (latent 4 channels, 2x2 patches).
        head_flops = 3 * 2.0 * 2 * model.hidden * 16
    compute = ComputeCoefficients(
        forward=fwd,
        backward=bwd,
        head_s_per_token=head_flops / linear_rate,
        microbatch_overhead_s=cfg.microbatch_fixed_s,
        linear_half_tokens=linear_half_tokens(hardware, cfg),
        attention_half_tokens=cfg.attention_half_tokens,
    )
    none_bytes, full_bytes = activation_bytes_per_token_layer(model)
    activation = ActivationCoefficients(
        bytes_per_token_layer_none=none_bytes,
        bytes_per_token_layer_full=full_bytes,
        working_bytes_per_token=working_bytes_per_token(model),
        fixed_working_bytes=cfg.fixed_working_bytes,
        transient_bytes_per_token=transient_bytes_per_token(model),
    )
    a2a_bytes, a2a_ops = alltoall_bytes_per_token_layer(model)
    intra = hardware.nvlink_bytes_per_s_per_direction * cfg.nvlink_efficiency
    inter = hardware.network_bytes_per_s_per_gpu * cfg.network_efficiency
    comm = CommCoefficients(
        alltoall_bytes_per_token_layer=a2a_bytes,
        alltoall_ops_per_layer=a2a_ops,
        alltoall=[
            LinkFit(placement="intra", alpha_s=cfg.intra_alpha_s, bytes_per_s=intra),
            LinkFit(placement="inter", alpha_s=cfg.inter_alpha_s, bytes_per_s=inter),
        ],
        allreduce=[
            LinkFit(placement="intra", alpha_s=cfg.intra_alpha_s, bytes_per_s=intra),
            LinkFit(placement="inter", alpha_s=cfg.inter_alpha_s, bytes_per_s=inter),
        ],
        grad_bytes_per_param=float(BF16_BYTES),
    )
    return CostModelFile(
        id=f"analytic-{model.name}-{hardware.name}",
        provenance="analytic",
        model=model,
        hardware=hardware.name,
        num_params=num_params(model),
        compute=compute,
        activation=activation,
        comm=comm,
        notes=(
            "Analytic default from public specs: linear efficiency "
            f"{cfg.linear_flops_efficiency}, attention efficiency {cfg.attention_flops_efficiency}, "
            f"dense half-performance length {linear_half_tokens(hardware, cfg):.0f} tokens per rank, "
            f"attention half-performance length {cfg.attention_half_tokens:.0f}, "
            f"{cfg.min_kernel_s * 1e6:.0f} us per kernel, "
            f"NVLink efficiency {cfg.nvlink_efficiency}, network efficiency {cfg.network_efficiency}."
        ),
    )
