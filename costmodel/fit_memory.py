"""Memory fitters of ``costmodel.fit``: kept activation bytes, the peak of a micro-batch, the head's
transient bytes.

* activation bytes: ``T * ((n - k)*none + k*full)`` for a record of ``n`` layers, ``k`` of them
  checkpointed, ``T`` tokens per rank (exact: saved tensors are counted, not timed).
* peak bytes (where records carry ``device_peak_bytes``): backward runs from the last layer
  down, the ``n - k`` plain layers first, each with its working set on top of what is still
  kept, then the ``k`` checkpointed ones, each rematerialising its activations once the plain
  layers above have freed theirs. The peak is the larger of the two phases::

      peak = T * (k*ckpt + max([k < n] * ((n - k)*none + transient), [k > 0] * recomputed)) + n*per_layer

  with ``none`` the kept bytes of a plain layer (from the activation bytes) and four free,
  non-negative coefficients: ``ckpt`` what the peak holds per checkpointed layer (its saved
  input; fitted only where the peaks need more than ``full``, by an F-test, since a free
  ``ckpt`` fitted to noisy peaks of two depths would scale badly to many layers),
  ``recomputed`` what one recomputed layer holds while its backward runs (its rematerialised
  activations with their working set), ``transient`` the working set of a plain layer's
  backward and ``per_layer`` the bytes of each layer whatever the tokens (weight-gradient
  buffers), plus ``buffers * T`` in records of groups of 2 or more (the all-to-all's send and
  receive buffers, when the profile has records alone too; the file holds them in
  ``working_bytes_per_token``). Every plausible structure is one point of this form: the
  rematerialised layer on top of the transient (``recomputed = none + transient``, the analytic form), the transient
  being the recomputed layer itself (``recomputed = none``), or a recomputed layer holding more
  than a plain one. The max is fitted by non-negative least squares in relative error, the
  records of ``0 < k < n`` assigned to the phase that peaks and refitted until the assignment
  holds (``costmodel.memory_costs.MemoryCosts.activation_bytes`` evaluates the same form).
* head transient: ``peak - saved = head_transient*T + c``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import nnls
from scipy.stats import f as f_dist

from costmodel.fit_terms import FloatArray, SplitConfig, TermResult, fit_linear_term, split_indices, term_result
from costmodel.profiling.format import ComputeRecord, HeadRecord

BoolArray = NDArray[np.bool_]
MAX_ASSIGN_ROUNDS = 20
"""Refits of the phase assignment of mixed-policy records before the last one is kept."""
CKPT_F_TEST_P = 0.001
"""A free per-checkpointed-layer coefficient is kept when the F-test of the better fit it gives
over ``ckpt = full`` has a p-value below this."""


def fit_activation(records: Sequence[ComputeRecord], split: SplitConfig) -> tuple[float, float, TermResult]:
    """``(none, full)`` bytes per token per layer."""
    if not any(r.recompute_layers > 0 for r in records) or not any(
            r.recompute_layers < r.num_layers for r in records):
        raise ValueError(
            "too few points for activation_bytes: need records with and without checkpointed layers"
        )
    a = np.array([[r.tokens_per_rank * (r.num_layers - r.recompute_layers),
                   r.tokens_per_rank * r.recompute_layers] for r in records], dtype=np.float64)
    y = np.array([r.activation_bytes for r in records], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("activation_bytes must be positive in every compute record")
    coef, result = fit_linear_term("activation_bytes", a, y, split)
    return float(coef[0]), float(coef[1]), result


@dataclass(frozen=True, slots=True)
class PeakFit:
    """Result of :func:`fit_peak` (bytes of the profiled shape)."""

    ckpt_bytes: float
    """Per token per checkpointed layer (``full`` unless the peaks need more)."""
    ckpt_free: bool
    """Whether ``ckpt_bytes`` was fitted (True) or is the activation fit's ``full``."""
    recomputed_bytes: float
    """Per token, one recomputed layer while its backward runs."""
    transient_bytes: float
    """Per token, the working set of a plain layer's backward."""
    per_layer_bytes: float
    """Per layer, whatever the tokens."""
    buffer_bytes: float
    """Per token, what a record in a group of 2 or more holds beyond one alone (the emulated
    all-to-all's send and receive buffers); 0 when the records do not tell."""
    result: TermResult

    def structure(self, none_bytes: float) -> str:
        """The structure the coefficients describe, in words (for the file's notes)."""
        extra = self.recomputed_bytes - none_bytes
        if abs(extra - self.transient_bytes) <= 0.02 * none_bytes:
            shape = "the rematerialised layer on top of the transient"
        elif abs(extra) <= 0.02 * none_bytes:
            shape = "the transient is the recomputed layer"
        else:
            shape = (f"the recomputed layer holds {extra - self.transient_bytes:+.4g} B per token beyond a plain "
                     "layer and its transient")
        return (f"peak form: {shape} (recomputed layer {self.recomputed_bytes:.4g} B, transient "
                f"{self.transient_bytes:.4g} B, per checkpointed layer {self.ckpt_bytes:.4g} B"
                f"{' fitted' if self.ckpt_free else ' = full'}, all-to-all buffers {self.buffer_bytes:.4g} B per "
                f"token; {self.per_layer_bytes:.4g} B per layer)")


def _phase_rows(records: Sequence[ComputeRecord], none_bytes: float, ckpt_bytes: float | None
                ) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, BoolArray, BoolArray]:
    """Per record, the design rows and known offsets of the plain and the recomputed phase.

    Columns: ``[ckpt (when free), recomputed, transient, per_layer, buffers (when some records
    ran in groups of 2 or more and some alone)]``."""
    t = np.array([r.tokens_per_rank for r in records], dtype=np.float64)
    n = np.array([r.num_layers for r in records], dtype=np.float64)
    k = np.array([r.recompute_layers for r in records], dtype=np.float64)
    grouped = np.array([r.group_size > 1 for r in records], dtype=np.float64)
    zero = np.zeros_like(t)
    ckpt_cols = [t * k] if ckpt_bytes is None else []
    ckpt_known = zero if ckpt_bytes is None else t * k * ckpt_bytes
    buffers = [t * grouped] if grouped.any() and not grouped.all() else []
    plain = np.stack([*ckpt_cols, zero, t, n, *buffers], axis=1)
    remat = np.stack([*ckpt_cols, t, zero, n, *buffers], axis=1)
    plain_known = ckpt_known + t * (n - k) * none_bytes
    return plain, remat, plain_known, ckpt_known, k < n, k > 0


def _fit_phases(y: FloatArray, plain: FloatArray, remat: FloatArray, plain_known: FloatArray,
                remat_known: FloatArray, has_plain: BoolArray, has_remat: BoolArray,
                train: NDArray[np.int64]) -> tuple[FloatArray, FloatArray]:
    """Non-negative coefficients of the max of two linear phases (relative error on ``train``);
    returns them and every record's prediction."""
    use_remat = ~has_plain  # mixed records start in the plain phase, as the analytic form has them
    coef = np.zeros(plain.shape[1])
    for _ in range(MAX_ASSIGN_ROUNDS):
        rows = np.where(use_remat[:, None], remat, plain)
        known = np.where(use_remat, remat_known, plain_known)
        yt = y[train]
        coef, _ = nnls(rows[train] / yt[:, None], (yt - known[train]) / yt, maxiter=50 * rows.shape[1])
        p_plain = np.where(has_plain, plain @ coef + plain_known, -np.inf)
        p_remat = np.where(has_remat, remat @ coef + remat_known, -np.inf)
        again = p_remat > p_plain
        if np.array_equal(again, use_remat):
            break
        use_remat = again
    pred = np.maximum(np.where(has_plain, plain @ coef + plain_known, -np.inf),
                      np.where(has_remat, remat @ coef + remat_known, -np.inf))
    return coef, pred


def fit_peak(records: Sequence[ComputeRecord], *, none_bytes: float, full_bytes: float,
             split: SplitConfig) -> PeakFit | None:
    """The peak form's coefficients from the records' peaks (None when no record has a peak).

    Raises:
        ValueError: when only some compute records carry ``device_peak_bytes``, or when the records
            have a single depth and the per-layer bytes cannot be told from per-token ones.
    """
    with_peak = [r for r in records if r.device_peak_bytes is not None]
    if not with_peak:
        return None
    if len(with_peak) != len(records):
        raise ValueError(f"peak_bytes: {len(records) - len(with_peak)} of {len(records)} compute records "
                         "have no device_peak_bytes (profile again with one version of dcp profile)")
    y = np.array([r.device_peak_bytes for r in records], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("device_peak_bytes must be positive in every compute record")
    if len({r.num_layers for r in records}) < 2:
        raise ValueError("peak_bytes: every compute record ran the same number of layers; profile "
                         "at least two depths (--layer-counts) to tell per-layer from per-token bytes")
    train, held = split_indices(len(y), fraction=split.holdout_fraction, min_train=4, seed=split.seed,
                                term="peak_bytes")

    def fit(ckpt: float | None) -> tuple[FloatArray, FloatArray, float]:
        plain, remat, plain_known, remat_known, has_plain, has_remat = _phase_rows(records, none_bytes, ckpt)
        coef, pred = _fit_phases(y, plain, remat, plain_known, remat_known, has_plain, has_remat, train)
        sse = float(np.sum(((pred[train] - y[train]) / y[train]) ** 2))
        return coef, pred, sse

    coef, pred, sse = fit(full_bytes)
    ckpt, free = full_bytes, False
    if any(r.recompute_layers > 0 for r in records):
        coef_free, pred_free, sse_free = fit(None)
        dof = len(train) - coef_free.size
        if dof > 0 and sse_free < sse:
            stat = (sse - sse_free) / max(sse_free / dof, 1e-300)
            if float(f_dist.sf(stat, 1, dof)) < CKPT_F_TEST_P and coef_free[0] <= none_bytes:
                ckpt, free, coef, pred = float(coef_free[0]), True, coef_free[1:], pred_free
    recomputed, transient, per_layer = (float(c) for c in coef[:3])
    buffers = float(coef[3]) if coef.size > 3 else 0.0
    return PeakFit(ckpt_bytes=ckpt, ckpt_free=free, recomputed_bytes=recomputed, transient_bytes=transient,
                   per_layer_bytes=per_layer, buffer_bytes=buffers,
                   result=term_result("peak_bytes", y, pred, train=train, held=held))


def fit_head_transient(records: Sequence[HeadRecord]) -> float | None:
    """Bytes per token of the head's backward beyond its saved tensors: NNLS of
    ``peak - saved = head_transient*T + c`` over the head records that carry a peak (None when
    none does; ``c``, the head's weight-gradient buffers, is a constant the micro-batch's fixed
    working bytes hold)."""
    with_peak = [r for r in records if r.device_peak_bytes is not None]
    if len(with_peak) < 2:
        return None
    tokens = np.array([r.tokens for r in with_peak], dtype=np.float64)
    extra = np.array([max(0.0, float(r.device_peak_bytes or 0.0) - r.activation_bytes) for r in with_peak])
    coef, _ = nnls(np.stack([tokens, np.ones_like(tokens)], axis=1), extra)
    return float(coef[0])
