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
  [KE] costmodel/presets/kernel_efficiency.json (docs/cost-model.md cites every point): flash
        attention throughput by sequence length, head dim, pass and mask (FlashAttention-3, Fig. 5
        and 6, H100) and GEMM throughput by rows (OpenXLA's matmul tables, H100 and B200). Where the
        hardware has them, they replace the constant efficiencies and half-performance lengths
        above: attention runs at the curve's efficiency at the sequence length of its kernel,
        GEMMs at the Hockney form fitted to the points (costmodel.kernel_efficiency).
  [NV] NVIDIA CUDA best-practices guide: kernel launch latency of a few microseconds; every
        kernel of a layer costs at least that, which dominates layers on few tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.kernel_efficiency import KernelEfficiency, kernel_efficiency
from costmodel.model_terms import (
    BF16_BYTES,
    FP32_BYTES,
    PAIR_TERMS,
    activation_bytes_per_sample_layer,
    activation_bytes_per_token_layer,
    alltoall_buffer_bytes_per_token,
    alltoall_bytes_per_token_layer,
    attention_flops_per_pair,
    kv_head_bytes_per_token_layer,
    linear_flops_per_token_layer,
    loss_chunk_bytes,
    num_params,
    terms,
    transient_bytes_per_token,
    working_bytes_per_token,
)
from costmodel.schema import (
    ActivationCoefficients,
    CommCoefficients,
    ComputeCoefficients,
    CostModelFile,
    LayerTimeTerms,
    LinkFit,
)
from costmodel.specs import LOSS_CHUNK_TOKENS_DEFAULT, HardwareSpec, ModelSpec

__all__ = ["BF16_BYTES", "FP32_BYTES", "AnalyticConfig", "activation_bytes_per_token_layer",
           "alltoall_bytes_per_token_layer", "analytic_cost_model", "attention_flops_per_pair",
           "linear_flops_per_token_layer", "linear_half_tokens", "num_params", "transient_bytes_per_token",
           "working_bytes_per_token"]


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
    kernels_per_layer_forward_3d: int = 26
    """Kernels in one forward call of a 3D DiT block (modulation, 3D rotary, self-attention,
    cross-attention, MLP)."""
    hbm_efficiency: float = 0.8
    """Achieved share of the memory bandwidth (sets the dense parts' half-performance length [W09])."""
    attention_half_tokens: float = 512.0
    """Half-performance length of attention over a sample's tokens per rank [D23b]."""
    microbatch_fixed_s: float = 1e-3
    """Fixed time per micro-batch outside the layers (data, loss, bookkeeping)."""
    fixed_working_bytes: float = 2e9
    """Allocator slack, NCCL buffers and workspaces per rank."""
    kernel_curves: bool = True
    """Price kernels with the published efficiency curves of the hardware where it has them [KE]
    (H100, H200, B200); False, or a hardware without them: the constants above."""
    extra: dict[str, float] = field(default_factory=dict)
    """Free-form overrides recorded in the notes."""

    def __post_init__(self) -> None:
        for name in ("linear_flops_efficiency", "attention_flops_efficiency", "nvlink_efficiency",
                     "network_efficiency", "hbm_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")


def linear_half_tokens(hardware: HardwareSpec, config: AnalyticConfig) -> float:
    """Half-performance length of the dense parts: achieved FLOP/s over achieved bytes/s [W09]."""
    flops = hardware.bf16_dense_flops * config.linear_flops_efficiency
    return flops / (hardware.hbm_bandwidth_bytes_per_s * config.hbm_efficiency)


def _loss_suffix(model: ModelSpec) -> str:
    """The id's mark of a text model's loss chunk other than the default (none at the default)."""
    if model.is_video or model.loss_chunk_tokens == LOSS_CHUNK_TOKENS_DEFAULT:
        return ""
    return "-whole-logits" if model.loss_chunk_tokens == 0 else f"-loss-chunk{model.loss_chunk_tokens}"


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
    curves = (kernel_efficiency(hardware.name, head_dim=model.head_size, causal=model.causal)
              if cfg.kernel_curves else None)
    linear_rate, attn_fwd_rate, attn_bwd_rate, linear_half, attention_half = _rates(hardware, cfg, curves)
    per_token_fwd = linear_flops_per_token_layer(model) / linear_rate
    per_pair_fwd = attention_flops_per_pair(model) / attn_fwd_rate
    per_pair_bwd = cfg.attention_bwd_over_fwd * attention_flops_per_pair(model) / attn_bwd_rate
    row = terms(model)
    # Text keys/values (cross-attention) or the text stream and its pairs (joint attention).
    per_sample_fwd = row.per_sample_flops(model) / linear_rate
    kernels = {"1d": cfg.kernels_per_layer_forward_1d, "2d": cfg.kernels_per_layer_forward_2d,
               "3d": cfg.kernels_per_layer_forward_3d}[model.kind]
    call_fwd = kernels * cfg.min_kernel_s
    # Attention pairs: the whole sequence (1d, 3d) or spatial and temporal pairs (2d).
    pair = dict.fromkeys(PAIR_TERMS[row.attention], per_pair_fwd)
    fwd = LayerTimeTerms(per_token=per_token_fwd, per_sample=per_sample_fwd, per_call=call_fwd, **pair)
    bwd = LayerTimeTerms(per_token=2 * per_token_fwd, per_sample=2 * per_sample_fwd, per_call=2 * call_fwd,
                         **dict.fromkeys(PAIR_TERMS[row.attention], per_pair_bwd))
    head_flops = row.head_flops_per_token(model)
    compute = ComputeCoefficients(
        forward=fwd,
        backward=bwd,
        head_s_per_token=head_flops / linear_rate,
        microbatch_overhead_s=cfg.microbatch_fixed_s,
        linear_half_tokens=linear_half,
        attention_half_tokens=attention_half,
        attention_efficiency=None if curves is None else curves.attention,
    )
    none_bytes, full_bytes = activation_bytes_per_token_layer(model)
    activation = ActivationCoefficients(
        bytes_per_token_layer_none=none_bytes,
        bytes_per_token_layer_full=full_bytes,
        working_bytes_per_token=working_bytes_per_token(model),
        alltoall_buffer_bytes_per_token=alltoall_buffer_bytes_per_token(model),
        fixed_working_bytes=cfg.fixed_working_bytes,
        loss_chunk_bytes=loss_chunk_bytes(model),
        transient_bytes_per_token=transient_bytes_per_token(model),
        kv_head_bytes_per_token_layer=kv_head_bytes_per_token_layer(model),
        bytes_per_sample_layer_none=activation_bytes_per_sample_layer(model),
    )
    a2a_bytes, a2a_ops = alltoall_bytes_per_token_layer(model)
    intra = hardware.nvlink_bytes_per_s_per_direction * cfg.nvlink_efficiency
    inter = hardware.network_bytes_per_s_per_gpu * cfg.network_efficiency
    comm = CommCoefficients(
        alltoall_bytes_per_token_layer=a2a_bytes,
        alltoall_ops_per_layer=a2a_ops,
        alltoall_kv_head_bytes_per_token_layer=kv_head_bytes_per_token_layer(model),
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
        id=f"analytic-{model.name}-{hardware.name}{_loss_suffix(model)}",
        provenance="analytic",
        model=model,
        hardware=hardware.name,
        num_params=num_params(model),
        compute=compute,
        activation=activation,
        comm=comm,
        notes=_notes(hardware, cfg, curves, linear_rate=linear_rate, linear_half=linear_half),
    )


def _rates(hardware: HardwareSpec, cfg: AnalyticConfig, curves: KernelEfficiency | None
           ) -> tuple[float, float, float, float, float]:
    """``(linear FLOP/s, attention forward FLOP/s, attention backward FLOP/s, linear_half_tokens,
    attention_half_tokens)``: from the published curves [KE] (attention at each pass's best
    efficiency, its fall on short inputs in the curve; GEMMs by the Hockney fit) where the hardware
    has them, else from the constant efficiencies and half-performance lengths [W09, D23b]."""
    if curves is None:
        attn = hardware.bf16_dense_flops * cfg.attention_flops_efficiency
        return (hardware.bf16_dense_flops * cfg.linear_flops_efficiency, attn, attn,
                linear_half_tokens(hardware, cfg), cfg.attention_half_tokens)
    peak = hardware.bf16_dense_flops  # the curves are shares of peak; the spec's peak scales them
    return (peak * curves.gemm.peak_efficiency, peak * curves.attention.forward.max_efficiency,
            peak * curves.attention.backward.max_efficiency, curves.gemm.half_rows, 0.0)


def _notes(hardware: HardwareSpec, cfg: AnalyticConfig, curves: KernelEfficiency | None, *,
           linear_rate: float, linear_half: float) -> str:
    common = (f"{cfg.min_kernel_s * 1e6:.0f} us per kernel, NVLink efficiency {cfg.nvlink_efficiency}, "
              f"network efficiency {cfg.network_efficiency}.")
    if curves is None:
        return ("Analytic default from public specs: linear efficiency "
                f"{cfg.linear_flops_efficiency}, attention efficiency {cfg.attention_flops_efficiency}, "
                f"dense half-performance length {linear_half:.0f} tokens per rank, "
                f"attention half-performance length {cfg.attention_half_tokens:.0f}, " + common)
    att = curves.attention
    return (f"Analytic default from public specs and published kernel throughput ({hardware.name}, "
            "costmodel/presets/kernel_efficiency.json): GEMMs "
            f"{linear_rate / hardware.bf16_dense_flops:.3f} of peak on many rows, half of it at "
            f"{linear_half:.0f} rows per rank (Hockney fit to the points); attention by its kernel's "
            f"sequence length, forward {att.forward.efficiency[0]:.3f} at {att.forward.tokens[0]:.0f} "
            f"to {att.forward.max_efficiency:.3f}, backward {att.backward.efficiency[0]:.3f} to "
            f"{att.backward.max_efficiency:.3f}"
            + (f" ({curves.notes})" if curves.notes else "") + "; " + common)
