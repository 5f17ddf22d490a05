"""The kernel efficiency a cost model prices a sample's layer with: achieved share of the
hardware's peak FLOP/s, from the file's times and the model's FLOPs (``dcp cost`` shows it).

For any cost model (analytic or fitted): the dense parts' efficiency over the call's rows per
rank ``n = s/d`` is their FLOPs over their time ``per_token * (n + linear_half_tokens)``;
attention's is its FLOPs (``costmodel.model_terms.attention_flops_per_pair`` per pair, the backward
2.5 times the forward as flash attention counts it) over its time
(:func:`costmodel.pass_terms.attention_s`), per pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel.evaluate import CostModel
from costmodel.model_terms import attention_flops_per_pair, linear_flops_per_token_layer
from costmodel.pass_terms import attention_s

BACKWARD_FLOPS_OVER_FORWARD = 2.5
"""Flash attention's backward FLOPs over its forward (5 matmuls against 2; FlashAttention-2/3)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelEfficiencies:
    """Shares of peak one layer of a sample runs at on one rank of a group of ``d``."""

    gemm: float
    """Dense parts (GEMMs) over the sample's ``s/d`` rows per rank (a call of this sample alone)."""
    attention_forward: float
    """Attention forward, at the sequence length its kernel runs on."""
    attention_backward: float
    """Attention backward."""


def kernel_efficiencies(cost_model: CostModel, *, tokens: int, group_size: int, frames: int = 1,
                        spatial: int | None = None) -> KernelEfficiencies:
    """What ``cost_model`` charges a sample of ``tokens`` (``frames`` x ``spatial`` for 2D models)
    on one rank of a group of ``group_size``, as shares of the hardware's peak."""
    file, peak = cost_model.file, cost_model.cluster.hardware.bf16_dense_flops
    c = file.compute
    rows = tokens / group_size
    dense_s = c.forward.per_token * (rows + c.linear_half_tokens)
    gemm = linear_flops_per_token_layer(file.model) * rows / (dense_s * peak) if dense_s > 0 else 0.0
    s, f = np.asarray(float(tokens)), np.asarray(float(frames))
    hw = s / f if spatial is None else np.asarray(float(spatial))
    pairs = f * hw * hw + hw * f * f if cost_model.is_2d else s * s
    flops = attention_flops_per_pair(file.model) * float(pairs) / group_size
    curves = c.attention_efficiency
    out = []
    for terms, curve, scale in ((c.forward, curves.forward if curves else None, 1.0),
                                (c.backward, curves.backward if curves else None, BACKWARD_FLOPS_OVER_FORWARD)):
        time_s = float(attention_s(terms, s, f, hw, attention=cost_model.attention, group_size=float(group_size),
                                   half_tokens=c.attention_half_tokens, efficiency=curve))
        out.append(scale * flops / (time_s * peak) if time_s > 0 else 0.0)
    return KernelEfficiencies(gemm=gemm, attention_forward=out[0], attention_backward=out[1])
