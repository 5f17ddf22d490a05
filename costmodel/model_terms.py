"""What a model's architecture costs per token and per layer, by model kind: one table, one row a kind.

These are counts (parameters, FLOPs, bytes) from public architecture numbers, with no hardware
and no efficiency; ``costmodel.analytic`` turns them into seconds, ``costmodel.fit`` uses their
ratios to scale a narrowed profile to the full width. A layer is what ``ModelSpec.num_layers``
counts: a decoder layer (1d), a spatial + temporal block pair (2d), one DiT block (3d).

Sources:
  [N21] Narayanan et al. 2021 (Megatron-LM), App.: 2 FLOPs per multiply-accumulate.
  [D23] Dao 2023 (FlashAttention-2): attention forward ``4*s^2*h`` FLOPs (QK^T and PV), half when
        causal.
  [K22] Korthikanti et al. 2022, Sec. 4.1: activation bytes per layer (adapted: flash attention
        keeps no s^2 scores, no dropout masks, bf16 activations).
  [J23] Jacobs et al. 2023 (DeepSpeed-Ulysses): all-to-alls of q, k, v in and the output out.
  [W25] Wan team 2025, "Wan: Open and Advanced Large-Scale Video Generative Models", Sec. 3:
        DiT blocks of full 3D self-attention over the patchified clip (1x2x2 patches of a
        4x8x8 VAE latent), cross-attention to the umT5 text embedding (512 tokens), a GELU MLP.
  [E24] Esser et al. 2024 (SD3, "Scaling Rectified Flow Transformers"), Sec. 4: MMDiT, text
        tokens joined to the image tokens in one attention, each stream with its own weights;
        HunyuanVideo (Kong et al. 2024) uses it for video (dual-stream, then single-stream).
  [U24] Fang & Zhao 2024 (USP), DeepSpeed-Ulysses' GQA path: past the key/value heads each
        rank receives the key/value head its query heads use (replicated).

Kinds:
  1d: decoder layer: attention (``q: h*inner``, ``k, v: h*h_kv``, ``o: inner*h``), SwiGLU MLP
      (3 matrices), 2 norms; output head ``V*h`` and input embedding (tied or not).
  2d: two blocks (spatial, temporal), each self-attention ``4h^2``, cross-attention to
      ``T`` text tokens (q, o per video token ``2h^2``, scores ``2*T*h``; k, v of the text
      ``2*T*h^2`` per sample), GELU MLP ``2hf``, adaLN.
  3d: one block: full self-attention over the clip's ``s`` tokens [W25], then either
      cross-attention to ``T`` text tokens as 2d's (Wan), or ``J`` text tokens joined to the
      attention [E24]: pairs ``(s + J)^2`` = ``s^2`` (the attention term) + ``2*s*J`` (per video
      token) + ``J^2`` (per sample), and the text stream's own projections and MLP on ``J``
      tokens per sample.
  The joined text tokens' own kept activations are per sample: under Ulysses a sample's ``J``
  text tokens are whole on every rank of its group (``executor/joint.py``), so each rank keeps
  ``J`` x the per-token bytes of each layer (kept, or its checkpointed input) for the sample, not
  split by the group; ``CostModel.activation_bytes`` adds them from the file's per-token bytes.
  Not counted: the text rows' share of a layer's backward transient and of the working buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from costmodel import layer_mix
from costmodel.activation_table import family_bytes_per_token_layer, has_family
from costmodel.specs import ModelSpec

BF16_BYTES = 2
FP32_BYTES = 4


def inner(model: ModelSpec) -> int:
    """Attention width ``heads * head_dim`` (the hidden size unless ``head_dim`` says otherwise)."""
    return model.num_heads * model.head_size


def kv_inner(model: ModelSpec) -> int:
    """Key/value width ``kv_heads * head_dim``."""
    return model.kv_heads * model.head_size


def mlp_macs_per_token(model: ModelSpec) -> float:
    """MLP multiply-accumulates per token: gated (SwiGLU) 3 matrices, GELU 2; a mixture of experts
    its active experts and router, averaged over the layers (:func:`costmodel.layer_mix.mlp_macs_per_token`)."""
    if model.num_experts:
        return layer_mix.mlp_macs_per_token(model)
    return (2 if model.mlp_kind == "gelu" else 3) * model.hidden * model.ffn_hidden


def _attn_proj_macs(model: ModelSpec) -> float:
    """q, k, v and o projections of one self-attention per token."""
    h = model.hidden
    return h * (inner(model) + 2 * kv_inner(model)) + inner(model) * h


@dataclass(frozen=True, kw_only=True, slots=True)
class KindTerms:
    """The architecture terms of one model kind (per layer unless said)."""

    attentions_per_layer: int
    """Self-attentions a layer runs (each a Ulysses all-to-all pair)."""
    attention: Literal["whole", "spatial_temporal"]
    """Which (query, key) pairs a sample of ``f`` frames of ``hw`` tokens has: ``whole``, one
    attention over all ``s = f*hw`` tokens (``s^2`` pairs; a text sample is ``f = 1``);
    ``spatial_temporal``, ``f*hw^2`` spatial and ``hw*f^2`` temporal pairs."""
    params_per_layer: Callable[[ModelSpec], float]
    """Parameters of one layer."""
    outer_params: Callable[[ModelSpec], float]
    """Parameters outside the layers (embeddings, head, patch embedding)."""
    linear_macs_per_token: Callable[[ModelSpec], float]
    """Forward MACs per video/text token of one layer that are linear in the sample's tokens."""
    per_sample_flops: Callable[[ModelSpec], float]
    """Forward FLOPs of one layer per sample, whatever its length (text keys/values, text stream)."""
    head_flops_per_token: Callable[[ModelSpec], float]
    """Forward + backward FLOPs per token outside the layers (output head or patch (un)embedding)."""
    none_bytes_per_token: Callable[[ModelSpec], float]
    """Activation bytes per token one layer keeps without checkpointing [K22]."""
    working_bytes_per_token: Callable[[ModelSpec], float]
    """Per-token buffers outside the layers (logits, last layer's output)."""
    head_values_per_token: Callable[[ModelSpec], float]
    """Values per token the output head's backward holds (1d: logits and their input ``V + h``;
    video: the un-patching projection's input ``h``); ``costmodel.fit`` scales the measured head
    bytes of a narrowed profile by its ratio."""


def _lse(model: ModelSpec) -> float:
    return float(FP32_BYTES * model.num_heads)


def _self_attention_bytes(model: ModelSpec) -> float:
    """Norm input, QKV input, q, k, v, output (``8h + 4h_kv`` at inner = h) and the log-sum-exp."""
    return BF16_BYTES * (2 * model.hidden + 2 * inner(model) + 2 * kv_inner(model)) + _lse(model)


def _mlp_bytes(model: ModelSpec) -> float:
    """Norm input and input (``4h``), then SwiGLU gate, up, activation, product ``8f`` or GELU ``4f``;
    experts or gpt-oss's clamped SwiGLU as :func:`costmodel.layer_mix.mlp_bytes_per_token` counts them."""
    if model.num_experts or model.mlp_kind == "swiglu_clamped":
        return layer_mix.mlp_bytes_per_token(model)
    f = model.ffn_hidden
    return BF16_BYTES * (2 * model.hidden + (4 * f if model.mlp_kind == "swiglu" else 2 * f))


def _cross_bytes(model: ModelSpec) -> float:
    """Cross-attention's q input, q and output, and its log-sum-exp."""
    return BF16_BYTES * 3 * model.hidden + _lse(model) if model.cross_attention_tokens else 0.0


def _cross_macs_per_token(model: ModelSpec) -> float:
    """Cross-attention per video token: q and o projections ``2h^2`` and scores against ``T`` text
    keys and values ``2*T*h``."""
    t = model.cross_attention_tokens
    return 2 * model.hidden * model.hidden + 2 * t * model.hidden if t else 0.0


def _cross_flops_per_sample(model: ModelSpec) -> float:
    """Cross-attention's k and v projections of the ``T`` text tokens: ``2*T*h^2`` MACs."""
    return 2.0 * 2 * model.cross_attention_tokens * model.hidden ** 2


WHOLE_LOSS_FP32_BUFFERS = 3
"""V-wide fp32 buffers per token at the peak of the whole-logits loss (``F.cross_entropy`` on the
upcast logits): the log-softmax it keeps, then in its backward the gradient of the negative
log-likelihood and of the log-softmax (counted on CPU with ``LiveBytesTracker``, bf16 and fp32
alike: 12 bytes a logit)."""


def _lm_head_passes(model: ModelSpec) -> int:
    """Head GEMMs per token (forward 1, backward 2 [N21]); the chunked loss runs the forward again
    in backward (``executor/chunked_loss.py``)."""
    return 4 if model.loss_chunk_tokens else 3


def _loss_bytes_per_token(model: ModelSpec) -> float:
    """Per-token bytes of the LM loss: whole logits, three fp32 buffers of ``V`` values
    (:data:`WHOLE_LOSS_FP32_BUFFERS`); chunked, the fp32 log-sum-exp it keeps for backward (its
    one chunk is :func:`loss_chunk_bytes`, per rank)."""
    if model.loss_chunk_tokens:
        return float(FP32_BYTES)
    return float(WHOLE_LOSS_FP32_BUFFERS * FP32_BYTES * model.vocab)


def loss_chunk_bytes(model: ModelSpec) -> float:
    """Bytes one rank's chunked LM loss holds at its peak, whatever the tokens: one chunk of
    ``loss_chunk_tokens`` tokens x ``V`` logits in bf16 and their fp32 copy
    (``executor.chunked_loss.chunk_peak_bytes``). The chunk counts a rank's local tokens (each
    rank runs the loss over its own sequence shard) and the vocabulary is whole on every rank, so
    the group does not divide it. 0 for whole logits and for video models."""
    if model.kind != "1d" or not model.loss_chunk_tokens:
        return 0.0
    return float(model.loss_chunk_tokens * model.vocab * (BF16_BYTES + FP32_BYTES))


def _mlp_params_per_layer(m: ModelSpec) -> float:
    """A 1d layer's MLP parameters: ``3hf``, or every expert and router averaged over the layers."""
    return layer_mix.mlp_params(m) / m.num_layers if m.num_experts else 3 * m.hidden * m.ffn_hidden


_1D = KindTerms(
    attentions_per_layer=1,
    attention="whole",
    params_per_layer=lambda m: (_attn_proj_macs(m) + _mlp_params_per_layer(m) + 2 * m.hidden
                                + layer_mix.sink_params_per_layer(m)),
    outer_params=lambda m: (1 if m.tied_embeddings else 2) * m.vocab * m.hidden + m.hidden,
    linear_macs_per_token=lambda m: _attn_proj_macs(m) + mlp_macs_per_token(m),
    per_sample_flops=lambda m: 0.0,
    head_flops_per_token=lambda m: _lm_head_passes(m) * 2.0 * m.hidden * m.vocab,  # output head [N21]
    none_bytes_per_token=lambda m: _self_attention_bytes(m) + _mlp_bytes(m),
    working_bytes_per_token=lambda m: _loss_bytes_per_token(m),
    head_values_per_token=lambda m: float(m.vocab + m.hidden),
)

_2D = KindTerms(
    attentions_per_layer=2,
    attention="spatial_temporal",
    params_per_layer=lambda m: 2 * (4 * m.hidden ** 2 + 4 * m.hidden ** 2 + 2 * m.hidden * m.ffn_hidden
                                    + 6 * m.hidden),
    outer_params=lambda m: 0.0,
    linear_macs_per_token=lambda m: 2 * (4 * m.hidden ** 2 + 2 * m.hidden ** 2 + mlp_macs_per_token(m)
                                         + 2 * m.cross_attention_tokens * m.hidden),
    per_sample_flops=lambda m: 2 * _cross_flops_per_sample(m),
    head_flops_per_token=lambda m: 3 * 2.0 * 2 * m.hidden * 16,  # patch embed in, projection out (4 ch, 2x2)
    none_bytes_per_token=lambda m: 2 * (_self_attention_bytes(m) + BF16_BYTES * 3 * m.hidden + _lse(m)
                                        + _mlp_bytes(m) + BF16_BYTES * 2 * m.hidden),
    working_bytes_per_token=lambda m: 2.0 * BF16_BYTES * m.hidden,  # last layer's input and output
    head_values_per_token=lambda m: float(m.hidden),
)


def _patch_values(m: ModelSpec) -> int:
    """Latent values per patch token: channels x patch volume (Wan: 16 x 1x2x2)."""
    t, ph, pw = m.patch_size or (1, 2, 2)
    return (m.latent_channels or 16) * t * ph * pw


def _joint_text_flops(m: ModelSpec) -> float:
    """The text stream of a joint-attention block per sample: its projections and MLP on ``J``
    tokens, and the ``J^2`` text-text pairs of the joined attention [E24]."""
    j = m.joint_attention_tokens
    return 2.0 * j * (_attn_proj_macs(m) + mlp_macs_per_token(m)) + 4.0 * inner(m) * j * j


def _params_3d(m: ModelSpec) -> float:
    """Parameters of one 3d layer (on average over the layers).

    Cross-attention (Wan [W25]): self-attention, cross-attention ``4h^2``, MLP, norms and the
    per-block modulation vectors ``6h`` (the modulation MLP is shared by all blocks). Joint
    attention (MMDiT [E24]): each stream's projections and MLP and its adaLN-Zero modulation
    linear ``h x 6h``; the first ``dual_stream_layers`` have a second (text) stream of their own.
    """
    stream = _attn_proj_macs(m) + 2 * m.hidden * m.ffn_hidden
    if m.joint_attention_tokens:
        per_stream = stream + 6 * m.hidden ** 2 + 4 * m.hidden
        return per_stream * (1 + m.dual_stream_layers / m.num_layers)
    return stream + (4 * m.hidden ** 2 if m.cross_attention_tokens else 0) + 6 * m.hidden


_3D = KindTerms(
    attentions_per_layer=1,
    attention="whole",
    params_per_layer=_params_3d,
    outer_params=lambda m: 2 * _patch_values(m) * m.hidden,
    # video token: self-attention projections, cross-attention (Wan) or its 2*J pairs with the
    # joined text tokens (4*inner FLOPs a pair = 2*inner MACs, MMDiT), the MLP
    linear_macs_per_token=lambda m: (_attn_proj_macs(m) + _cross_macs_per_token(m) + mlp_macs_per_token(m)
                                     + 2 * m.joint_attention_tokens * 2 * inner(m)),
    per_sample_flops=lambda m: _cross_flops_per_sample(m) + _joint_text_flops(m),
    head_flops_per_token=lambda m: 3 * 2.0 * 2 * m.hidden * _patch_values(m),  # patch embed in, out
    none_bytes_per_token=lambda m: (_self_attention_bytes(m) + _cross_bytes(m) + _mlp_bytes(m)
                                    + BF16_BYTES * 2 * m.hidden),  # adaLN-modulated inputs
    working_bytes_per_token=lambda m: 2.0 * BF16_BYTES * m.hidden,
    head_values_per_token=lambda m: float(m.hidden),
)

PAIR_TERMS: dict[str, tuple[str, ...]] = {"whole": ("per_attn_pair",),
                                          "spatial_temporal": ("per_spatial_pair", "per_temporal_pair")}
"""The ``LayerTimeTerms`` fields (``costmodel.schema``) that price each kind of attention pairs."""

KIND_TERMS: dict[str, KindTerms] = {"1d": _1D, "2d": _2D, "3d": _3D}
"""The table: one row a model kind."""


def terms(model: ModelSpec) -> KindTerms:
    """The row of ``model``'s kind."""
    return KIND_TERMS[model.kind]


def num_params(model: ModelSpec) -> int:
    """Parameters of the model (linear layers, norms, embeddings)."""
    row = terms(model)
    total = model.num_layers * row.params_per_layer(model) + row.outer_params(model)
    return round(total) if model.num_experts else int(total)  # experts: a per-layer mean


def linear_flops_per_token_layer(model: ModelSpec) -> float:
    """Forward FLOPs per token per layer of the parts linear in the tokens [N21]."""
    return 2.0 * terms(model).linear_macs_per_token(model)


def attention_flops_per_pair(model: ModelSpec) -> float:
    """Forward attention FLOPs per (query, key) pair per attention: ``4*inner``, half when causal
    [D23]."""
    return (2.0 if model.causal else 4.0) * inner(model)


def activation_bytes_per_token_layer(model: ModelSpec) -> tuple[float, float]:
    """(none, full) activation bytes per token per layer; full keeps only the layer input ``2h``.

    A model of a family counted on its real layer classes (``ModelSpec.family``,
    :mod:`costmodel.activation_table`) takes the counted coefficients (they include the fp32
    copies the real norms and modulations save); any other model the formula of its kind [K22].
    """
    if has_family(model):
        none, full, _ = family_bytes_per_token_layer(model)
        return none, full
    return float(terms(model).none_bytes_per_token(model)), float(BF16_BYTES * model.hidden)


def activation_bytes_per_sample_layer(model: ModelSpec) -> float:
    """Bytes one plain layer keeps per sample whatever its tokens (a counted family's
    cross-attention text keys and values, :mod:`costmodel.activation_table`); 0 otherwise."""
    return family_bytes_per_token_layer(model)[2] if has_family(model) else 0.0


def transient_bytes_per_token(model: ModelSpec) -> float:
    """Working set per token while one layer runs backward beyond the kept activations: the MLP's
    largest intermediate gradients (SwiGLU ``3*2f``, GELU ``2*2f``) and the fp32 q, k, v gradient
    accumulators of flash attention ``4*(inner + 2*kv_inner)``."""
    width = layer_mix.mlp_transient_width(model) if model.num_experts else model.ffn_hidden
    mlp = BF16_BYTES * (2 if model.mlp_kind == "gelu" else 3) * width
    return float(mlp + FP32_BYTES * (inner(model) + 2 * kv_inner(model)))


def working_bytes_per_token(model: ModelSpec) -> float:
    """Per-token buffers outside the layers (the kind's: logits, or the last layer's input and output)."""
    return terms(model).working_bytes_per_token(model)


def alltoall_buffer_bytes_per_token(model: ModelSpec) -> float:
    """The Ulysses send and receive buffers of q, k, v per token (``2 * 3 * 2h``), held in groups
    whose Ulysses degree is above 1."""
    return 2.0 * 3 * BF16_BYTES * model.hidden


def alltoall_bytes_per_token_layer(model: ModelSpec, *, dtype_bytes: int = BF16_BYTES) -> tuple[float, int]:
    """(bytes per token, operations) of one pass of a layer's all-to-alls, as the executor runs them.

    Each attention moves q, k, v in one fused operation (``inner + 2*kv_inner`` values per token)
    and the output back in another (``inner``) [J23]. Past the key/value heads, add
    :func:`kv_head_bytes_per_token_layer` per head of replication. Backward runs the same
    operations reversed, a recompute runs them again.
    """
    per_attention = dtype_bytes * (2 * inner(model) + 2 * kv_inner(model))
    n = terms(model).attentions_per_layer
    return float(per_attention * n), 2 * n


def kv_head_bytes_per_token_layer(model: ModelSpec, *, dtype_bytes: int = BF16_BYTES) -> float:
    """Bytes of one key/value head's k and v per token per layer (all its attentions): what each
    head of replication adds to the all-to-all and to the kept activations [U24].

    In a group of ``d > kv_heads`` ranks each rank needs the key/value head of its query heads,
    so each token's k and v go to ``d`` ranks instead of ``kv_heads``: ``d - kv_heads`` more
    heads sent, and each rank keeps one head for the whole sequence instead of ``kv_heads / d``.
    """
    return float(dtype_bytes * 2 * model.head_size * terms(model).attentions_per_layer)


def kv_replicas(model: ModelSpec, group_size: int) -> int:
    """Extra key/value heads per token in a group of ``group_size``: ``max(0, d - kv_heads)``."""
    return max(0, group_size - model.kv_heads)
