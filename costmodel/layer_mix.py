"""A text decoder whose layers differ: mixture-of-experts or dense MLPs, full or sliding-window
attention. Counts per layer averaged over the ``L`` layers (the cost model's terms are per layer
and every policy multiplies them by a number of layers), so a dense full-attention model gets
exactly the dense counts of :mod:`costmodel.model_terms`.

Sources:
  [S17] Shazeer et al. 2017, "Outrageously Large Neural Networks": a router (``h x E`` gate) picks
        the top ``k`` of ``E`` experts per token; only those run. Qwen3-MoE, Mixtral and gpt-oss
        implement it with gated-MLP experts (transformers 5.24, ``*SparseMoeBlock`` / ``GptOssMLP``).
  [L21] Lepikhin et al. 2021 (GShard), Sec. 2-3: expert parallelism, each token dispatched to its
        experts' ranks by one all-to-all and combined back by another.
  [B20] Beltagy et al. 2020 (Longformer), Sec. 3: sliding-window attention costs ``s x w``, not
        ``s^2``. Gemma 3 (5 local layers of 1,024 tokens per global one) and gpt-oss (alternating
        128-token and full layers) use it; transformers' sliding causal mask lets query ``i`` see
        keys ``i - w + 1 .. i``.
  [X24] Xiao et al. 2024 (StreamingLLM), attention sinks; gpt-oss learns one sink logit per head
        that joins every softmax: ``num_heads`` parameters a layer, no matrix product.

Pairs. A causal full layer has ``s(s + 1)/2`` (query, key) pairs, which the dense model counts as
``s^2`` at half the FLOPs a pair (``attention_flops_per_pair``): twice the pairs less ``s``. A
causal window of ``w`` has ``sum_i min(i + 1, w)`` pairs, in the same units ``s^2 - m(m + 1)`` with
``m = max(0, s - w)`` (``s^2`` while the sample fits the window, about ``2sw - w^2`` past it):
linear in ``s``.

Bytes (kept for backward per token of a MoE layer), as the transformers classes keep them: the block
input ``h``; per routed copy (``k`` a token) the gathered input ``h``, the expert's down-projection
output and its weighted copy ``2h``, the gate/up output ``2f_e`` and the gated product's inputs and
output ``2f_e`` (gpt-oss's clamped SwiGLU ``5f_e``: clamps, sigmoid, ``up + 1``), and the routing
weight; the router's fp32 probabilities ``E``; int64 indices ``3k`` (top-k, and per copy its token
and slot). Shared experts keep their gated values ``4f_e`` each.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.specs import ModelSpec

BF16_BYTES = 2
FP32_BYTES = 4
INDEX_BYTES = 8
"""int64 routing indices (``torch.topk``, ``torch.where``)."""


def is_mixed(model: ModelSpec) -> bool:
    """True when some layer is MoE or windowed (the dense formulas do not hold as they are)."""
    return bool(model.num_experts or model.num_sliding_layers)


def gated_values(model: ModelSpec) -> int:
    """Intermediate values of width ``f`` a gated MLP keeps: gate and up (one ``2f`` output), the
    activation and the product: 4; gpt-oss's clamped SwiGLU 7 (clamped gate and up, sigmoid,
    ``up + 1``)."""
    return 7 if model.mlp_kind == "swiglu_clamped" else 4


def mlp_matrices(model: ModelSpec) -> int:
    """Weight matrices of one MLP (gated: 3, GELU: 2)."""
    return 2 if model.mlp_kind == "gelu" else 3


def expert_params(model: ModelSpec) -> int:
    """Parameters of every expert and router of the model (all ``E`` experts, shared ones too)."""
    m = model
    per_layer = mlp_matrices(m) * m.hidden * (m.expert_ffn_hidden or 0) * (m.num_experts + m.num_shared_experts)
    return m.num_moe_layers * (per_layer + m.hidden * m.num_experts)


def mlp_params(model: ModelSpec) -> int:
    """MLP parameters summed over the layers: dense layers ``3hf`` (GELU ``2hf``), MoE layers all
    their experts and the router [S17]."""
    dense_layers = model.num_layers - model.num_moe_layers
    return dense_layers * mlp_matrices(model) * model.hidden * model.ffn_hidden + expert_params(model)


def sink_params_per_layer(model: ModelSpec) -> int:
    """One learned sink logit per query head when the model has sinks [X24]."""
    return model.num_heads if model.attention_sinks else 0


def mlp_macs_per_token(model: ModelSpec) -> float:
    """MLP multiply-accumulates per token, averaged over the layers: a dense layer ``3hf``, a MoE
    layer its ``k`` routed and shared experts ``3h f_e (k + shared)`` and the router ``hE`` [S17]."""
    m = model
    dense = mlp_matrices(m) * m.hidden * m.ffn_hidden
    if not m.num_experts:
        return float(dense)
    moe = (mlp_matrices(m) * m.hidden * (m.expert_ffn_hidden or 0) * (m.num_experts_per_token + m.num_shared_experts)
           + m.hidden * m.num_experts)
    return ((m.num_layers - m.num_moe_layers) * dense + m.num_moe_layers * moe) / m.num_layers


def moe_block_bytes_per_token(model: ModelSpec) -> float:
    """Bytes one MoE block (router and experts) keeps per token for backward (module docstring)."""
    m = model
    f_e, k = m.expert_ffn_hidden or 0, m.num_experts_per_token
    values = m.hidden + k * (3 * m.hidden + gated_values(m) * f_e + 1) + 4 * f_e * m.num_shared_experts
    return float(BF16_BYTES * values + FP32_BYTES * m.num_experts + INDEX_BYTES * 3 * k)


def dense_block_bytes_per_token(model: ModelSpec) -> float:
    """Bytes a dense MLP block keeps per token: its input ``h`` and its gated values (GELU ``2f``)."""
    values = 2 if model.mlp_kind == "gelu" else gated_values(model)
    return float(BF16_BYTES * (model.hidden + values * model.ffn_hidden))


def mlp_bytes_per_token(model: ModelSpec) -> float:
    """Bytes the MLP half of a layer keeps per token, averaged over the layers: the norm's input
    ``h`` and the block (dense or MoE)."""
    m = model
    block = dense_block_bytes_per_token(m)
    if m.num_experts:
        block = ((m.num_layers - m.num_moe_layers) * block + m.num_moe_layers * moe_block_bytes_per_token(m)
                 ) / m.num_layers
    return BF16_BYTES * m.hidden + block


def mlp_transient_width(model: ModelSpec) -> float:
    """Width whose gradients a layer's MLP backward holds at once per token (``f``; a MoE layer's
    ``k`` routed and shared experts ``f_e (k + shared)``), the largest over the layers."""
    m = model
    widths = [float(m.ffn_hidden)] if m.num_moe_layers < m.num_layers else []
    if m.num_experts:
        widths.append(float((m.expert_ffn_hidden or 0) * (m.num_experts_per_token + m.num_shared_experts)))
    return max(widths)


def attention_pairs(model: ModelSpec, tokens: ArrayLike) -> NDArray[np.float64]:
    """(query, key) pairs of one layer's attention per sample in ``s^2`` units, averaged over the
    layers: ``s^2`` for a full layer, ``s^2 - m(m + 1)`` with ``m = max(0, s - w)`` for a window
    ``w`` [B20]."""
    s = np.asarray(tokens, dtype=np.float64)
    full = s * s
    if not model.num_sliding_layers:
        return full
    windowed = window_pairs(s, float(model.sliding_window or 0))
    n_slide = model.num_sliding_layers
    return np.asarray(((model.num_layers - n_slide) * full + n_slide * windowed) / model.num_layers,
                      dtype=np.float64)


def window_pairs(tokens: ArrayLike, window: float) -> NDArray[np.float64]:
    """(query, key) pairs of a causal window of ``window`` tokens per sample in the dense model's
    ``s^2`` units (twice the pairs less ``s``): ``s^2 - m(m + 1)``, ``m = max(0, s - w)`` [B20]."""
    s = np.asarray(tokens, dtype=np.float64)
    past = np.maximum(s - float(window), 0.0)
    return np.asarray(s * s - past * (past + 1.0), dtype=np.float64)


def expert_alltoall_bytes_per_token_layer(model: ModelSpec, *, dtype_bytes: int = BF16_BYTES) -> float:
    """Bytes per token per layer (averaged over the layers) of one pass's expert-parallel
    all-to-alls: each token's ``k`` routed copies of ``h`` values out (dispatch) and back
    (combine) [L21]; backward runs the same two reversed, a recompute runs them again."""
    m = model
    if not m.num_experts:
        return 0.0
    return 2.0 * dtype_bytes * m.num_experts_per_token * m.hidden * m.num_moe_layers / m.num_layers
