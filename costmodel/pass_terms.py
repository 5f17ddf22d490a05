"""One layer pass's seconds that each sample adds, on one rank of a group of ``d``: the functional
forms of :mod:`costmodel.schema` (dense per token, attention pairs over the efficiency curve, per
sample, the Ulysses re-layout), evaluated by :class:`costmodel.evaluate.CostModel`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from costmodel.schema import LayerTimeTerms

FloatArray = NDArray[np.float64]


def attention_s(terms: LayerTimeTerms, tokens: FloatArray, frames: FloatArray, spatial: FloatArray,
                *, attention: str, group_size: float, half_tokens: float) -> FloatArray:
    """Attention seconds of one pass on one rank: pairs/d over the efficiency ``n/(n + n_half)``
    of the sample's ``n = s/d`` tokens per rank, i.e. ``pairs/d + n_half * pairs/s``; the pairs
    of the kind's ``attention`` (``costmodel.model_terms.KindTerms``)."""
    if attention == "spatial_temporal":
        pairs = (terms.per_spatial_pair * frames * spatial * spatial
                 + terms.per_temporal_pair * spatial * frames * frames)
    else:
        pairs = terms.per_attn_pair * tokens * tokens
    return np.asarray(pairs / group_size + half_tokens * pairs / tokens, dtype=np.float64)


def sample_pass_s(terms: LayerTimeTerms, tokens: FloatArray, frames: FloatArray, spatial: FloatArray,
                  *, attention: str, group_size: float, half_tokens: float) -> FloatArray:
    """Part of one layer pass additive over samples (dense per token, attention, per sample, the
    Ulysses re-layout in groups of 2 or more), in seconds on one rank of a group of ``group_size``."""
    attn = attention_s(terms, tokens, frames, spatial, attention=attention, group_size=group_size,
                       half_tokens=half_tokens)
    relayout = terms.per_token_relayout * tokens / group_size if group_size > 1 else 0.0
    return np.asarray(terms.per_token * tokens / group_size + attn + terms.per_sample + relayout,
                      dtype=np.float64)
