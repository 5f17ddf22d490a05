"""The ring's coefficients (:class:`costmodel.schema.RingCoefficients`) fitted to measurements.

* ``ring_step`` records of ``dcp profile-comm --ops ring_step``: a hop posted beside a
  computation, with the hop alone (``hop_s``) and the computation alone (``compute_s``) timed in
  the same rounds. The step's form is ``max(c, h) + exposed_fraction * min(c, h) + step_overhead_s``
  (:func:`costmodel.ring.timing.step_s`), linear in the two unknowns once ``max`` is known:
  non-negative least squares on ``(t - max(c, h)) / t`` against ``[min(c, h), 1] / t`` (relative
  errors), the exposed fraction capped at 1.
* ``ring_attention`` records of ``dcp profile --ring-degrees``: one rank's ring steps on a sample's
  blocks (``time_s``) beside the same pairs as one kernel (``ulysses_time_s``). What the ring adds
  is ``ulysses_time_s * block_half_tokens / (s/r)`` (its blocks' lower efficiency, a Hockney term
  over the block's tokens) plus ``(r - 1)`` merges of ``s/r`` queries x ``num_heads * head_dim``
  channels at ``merge_bytes_per_channel`` each over the hardware's HBM bandwidth; both
  non-negative, fitted the same way.

Each term is checked on held-out records (``fit_quality["ring_step"]``, ``["ring_attention"]``); a
term without records keeps its published default, and the coefficients' ``source`` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from costmodel.fit_terms import FloatArray, SplitConfig, TermResult, mape, split_indices
from costmodel.profiling.format import CommRecord, RingAttentionRecord
from costmodel.schema import RingCoefficients


@dataclass(frozen=True, slots=True)
class RingFit:
    """Fitted ring coefficients and the held-out quality of each fitted term."""

    coefficients: RingCoefficients
    terms: dict[str, TermResult]


def _relative_nnls(a: FloatArray, excess: FloatArray, total: FloatArray) -> FloatArray:
    """Non-negative ``x`` minimising ``sum(((a @ x - excess) / total)^2)``."""
    sol, _ = nnls(a / total[:, None], excess / total, maxiter=50 * a.shape[1])
    return np.asarray(sol, dtype=np.float64)


def _fit_held_out(name: str, a: FloatArray, base: FloatArray, total: FloatArray, split: SplitConfig
                  ) -> tuple[FloatArray, TermResult]:
    """Fit ``total ~ base + a @ x`` on the training records, check it on the held-out ones, then
    refit on all (the coefficients kept)."""
    train, held = split_indices(len(total), fraction=split.holdout_fraction, min_train=a.shape[1], seed=split.seed,
                                term=name)
    x = _relative_nnls(a[train], total[train] - base[train], total[train])
    predicted = base[held] + a[held] @ x
    result = TermResult(name, mape(total[held], predicted), len(train), len(held), total[held], predicted,
                        tuple(int(i) for i in held))
    return _relative_nnls(a, total - base, total), result


def fit_ring_steps(records: Sequence[CommRecord], split: SplitConfig) -> tuple[float, float, TermResult]:
    """``(exposed_fraction, step_overhead_s, held-out result)`` from ``ring_step`` records.

    Raises:
        ValueError: for fewer than three records (two unknowns and one to check).
    """
    c = np.array([r.compute_s for r in records], dtype=np.float64)
    h = np.array([r.hop_s for r in records], dtype=np.float64)
    t = np.array([r.time_s for r in records], dtype=np.float64)
    a = np.stack([np.minimum(c, h), np.ones_like(c)], axis=1)
    x, result = _fit_held_out("ring_step", a, np.maximum(c, h), t, split)
    return float(min(x[0], 1.0)), float(x[1]), result


def fit_ring_attention(records: Sequence[RingAttentionRecord], split: SplitConfig, *, hbm_bytes_per_s: float
                       ) -> tuple[float, float, TermResult]:
    """``(block_half_tokens, merge_bytes_per_channel, held-out result)`` from ``ring_attention``
    records.

    Raises:
        ValueError: for fewer than three records.
    """
    s = np.array([r.tokens for r in records], dtype=np.float64)
    r_ = np.array([r.ring_degree for r in records], dtype=np.float64)
    ulysses = np.array([r.ulysses_time_s for r in records], dtype=np.float64)
    channels = np.array([r.num_heads * r.head_dim for r in records], dtype=np.float64)
    t = np.array([r.time_s for r in records], dtype=np.float64)
    a = np.stack([ulysses * r_ / s, (r_ - 1) * s / r_ * channels / hbm_bytes_per_s], axis=1)
    x, result = _fit_held_out("ring_attention", a, ulysses, t, split)
    return float(x[0]), float(x[1]), result


def fit_ring(steps: Sequence[CommRecord], attention: Sequence[RingAttentionRecord], split: SplitConfig, *,
             hbm_bytes_per_s: float) -> RingFit | None:
    """The ring's coefficients from whichever records there are; None without any.

    Raises:
        ValueError: from the term fitters (too few records of a kind).
    """
    steps = [r for r in steps if r.op == "ring_step"]
    if not steps and not attention:
        return None
    default = RingCoefficients()
    update: dict[str, float] = {}
    terms: dict[str, TermResult] = {}
    sources = []
    if steps:
        phi, overhead, terms["ring_step"] = fit_ring_steps(steps, split)
        update |= {"exposed_fraction": phi, "step_overhead_s": overhead}
        sources.append(f"exposed_fraction and step_overhead_s fitted to {len(steps)} ring_step records")
    else:
        sources.append("exposed_fraction and step_overhead_s: published defaults (no ring_step records)")
    if attention:
        half, merge, terms["ring_attention"] = fit_ring_attention(attention, split, hbm_bytes_per_s=hbm_bytes_per_s)
        update |= {"block_half_tokens": half, "merge_bytes_per_channel": max(merge, 1e-9)}
        sources.append(f"block_half_tokens and merge_bytes_per_channel fitted to {len(attention)} ring_attention "
                       "records")
    else:
        sources.append("block_half_tokens and merge_bytes_per_channel: defaults (no ring_attention records)")
    return RingFit(coefficients=default.model_copy(update={**update, "source": "; ".join(sources)}), terms=terms)
