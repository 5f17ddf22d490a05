"""One layer pass's seconds that each sample adds, on one rank of a group of ``d``: the functional
forms of :mod:`costmodel.schema` (dense per token, attention pairs over the efficiency curve, per
sample, the Ulysses re-layout), evaluated by :class:`costmodel.evaluate.CostModel`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from costmodel.schema import EfficiencyCurve, LayerTimeTerms

FloatArray = NDArray[np.float64]


def attention_s(terms: LayerTimeTerms, tokens: FloatArray, frames: FloatArray, spatial: FloatArray,
                *, attention: str, group_size: float, half_tokens: float,
                efficiency: EfficiencyCurve | None = None, whole_pairs: FloatArray | None = None) -> FloatArray:
    """Attention seconds of one pass on one rank; the pairs of the kind's ``attention``
    (``costmodel.model_terms.KindTerms``): ``s^2``, or ``whole_pairs`` where a text decoder's layers
    differ (sliding windows, :func:`costmodel.layer_mix.attention_pairs`).

    With an ``efficiency`` curve: ``pairs/d`` at the curve's time multiplier for the sequence length
    the kernel runs on (after the Ulysses all-to-all a rank attends the whole sample, ``s`` tokens;
    the spatial pairs of a 2D model over ``h*w``, the temporal over ``f``). Without: pairs/d over
    the efficiency ``n/(n + n_half)`` of the sample's ``n = s/d`` tokens per rank, i.e.
    ``pairs/d + n_half * pairs/s``."""
    if efficiency is not None:
        if attention == "spatial_temporal":
            pairs = (terms.per_spatial_pair * frames * spatial * spatial * efficiency.time_multiplier(spatial)
                     + terms.per_temporal_pair * spatial * frames * frames * efficiency.time_multiplier(frames))
        else:
            whole = tokens * tokens if whole_pairs is None else whole_pairs
            pairs = terms.per_attn_pair * whole * efficiency.time_multiplier(tokens)
        return np.asarray(pairs / group_size, dtype=np.float64)
    if attention == "spatial_temporal":
        pairs = (terms.per_spatial_pair * frames * spatial * spatial
                 + terms.per_temporal_pair * spatial * frames * frames)
    elif whole_pairs is not None:
        pairs = terms.per_attn_pair * whole_pairs
    else:
        pairs = terms.per_attn_pair * tokens * tokens
    return np.asarray(pairs / group_size + half_tokens * pairs / tokens, dtype=np.float64)


def sample_pass_s(terms: LayerTimeTerms, tokens: FloatArray, frames: FloatArray, spatial: FloatArray,
                  *, attention: str, group_size: float, half_tokens: float,
                  efficiency: EfficiencyCurve | None = None, whole_pairs: FloatArray | None = None) -> FloatArray:
    """Part of one layer pass additive over samples (dense per token, attention, per sample, the
    Ulysses re-layout in groups of 2 or more), in seconds on one rank of a group of ``group_size``."""
    attn = attention_s(terms, tokens, frames, spatial, attention=attention, group_size=group_size,
                       half_tokens=half_tokens, efficiency=efficiency, whole_pairs=whole_pairs)
    relayout = terms.per_token_relayout * tokens / group_size if group_size > 1 else 0.0
    return np.asarray(terms.per_token * tokens / group_size + attn + terms.per_sample + relayout,
                      dtype=np.float64)
