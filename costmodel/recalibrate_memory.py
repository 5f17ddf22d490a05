"""Online recalibration of memory: the factor on a micro-batch's bytes per token, from measured peaks.

A rank's predicted peak in a step is ``fixed + max_i var_i`` over its micro-batches ``i``:
``fixed`` the model states and fixed working buffers (``CostModel.fixed_bytes``), ``var_i`` the
bytes that grow with the tokens (``CostModel.activation_bytes`` summed over the micro-batch's
samples: activations kept, the head's and the layers' working sets). Every per-token
coefficient of the file is multiplied by one factor ``a`` (``TermScales.activation``), so the
peak under ``a`` is ``fixed + a * max_i var_i``.

Unlike times, a step's peak does not straggle: the allocator's peak of equal work is the same
every time. The fit is therefore the smallest factor under which no measured step exceeds its
prediction, ``a = max_j (peak_j - fixed_j) / var_j``, over the steps whose per-token bytes are a
fair share of their peak (``min_share``: below it the measured peak says more about ``fixed``
than about ``a``, and a small error there would read as a large factor). A measured step then
never runs over the memory cap the planner keeps for it, which is what an out-of-memory error
would cost; when the model over-states the bytes the factor falls below 1 and plans may use
the memory the model was keeping back. Peaks exist where the device has an allocator peak
(CUDA); a CPU rank reports none and the factor stays where it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.evaluate import CostModel
from costmodel.ring.layout import GroupLayout
from costmodel.specs import Sample

MIN_SHARE = 0.2
"""Share of a measured peak the per-token bytes must predict for the step to be fitted."""


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryFit:
    """The fitted memory factor and how the predictions of the measured peaks change."""

    factor: float
    """Factor on the per-token bytes (the prior when no step could be fitted)."""
    fitted: bool
    """Whether any step had enough per-token bytes to fit on."""
    num_points: int
    """Measured step peaks fitted (of ``num_measured``)."""
    num_measured: int
    """Measured step peaks given."""
    max_under_before: float | None
    """Largest ``measured / predicted - 1`` under the prior (positive: the model said too little)."""
    max_under_after: float | None
    """The same under the fitted factor (at most 0 on the fitted steps)."""
    mape_before: float | None
    """Mean absolute percentage error of the peaks under the prior."""
    mape_after: float | None
    """The same under the fitted factor."""


def step_peak_parts_bytes(model: CostModel, micro_batches: Sequence[tuple[Sequence[Sample], Sequence[int]]],
                          *, group_size: int, layout: GroupLayout | None = None) -> tuple[float, float]:
    """``(fixed, var)`` of one rank's step under ``model``: its peak is ``fixed + var``.

    Args:
        model: The base cost model (factor 1).
        micro_batches: ``(samples, policies)`` of each micro-batch of the rank's group.
        group_size: Ranks of the group.
        layout: Its Ulysses x ring layout (None: pure Ulysses): a ring's key/value buffers count.

    Raises:
        ValueError: for a step without micro-batches.
    """
    if not micro_batches:
        raise ValueError("a step's peak needs at least one micro-batch")
    var = max(float(model.activation_bytes([s.tokens for s in samples], group_size=group_size,
                                           recompute_layers=list(policies), layout=layout).sum())
              for samples, policies in micro_batches)
    return model.fixed_bytes(), var


def fit_activation_scale(fixed_bytes: Sequence[float], var_bytes: Sequence[float],
                         measured_peak_bytes: Sequence[float], *, prior: float = 1.0,
                         min_share: float = MIN_SHARE) -> MemoryFit:
    """The smallest factor under which no fitted step's measured peak exceeds its prediction.

    Args:
        fixed_bytes: Per step, the predicted bytes that do not grow with the tokens.
        var_bytes: Per step, the predicted per-token bytes of its largest micro-batch (factor 1).
        measured_peak_bytes: Per step, the measured peak (the largest over the group's ranks).
        prior: The factor before this fit (kept when no step can be fitted).
        min_share: A step is fitted when ``prior * var`` is at least this share of its peak.

    Raises:
        ValueError: for lengths that differ, or values that are not finite and positive.
    """
    fixed = np.asarray(fixed_bytes, dtype=np.float64)
    var = np.asarray(var_bytes, dtype=np.float64)
    peak = np.asarray(measured_peak_bytes, dtype=np.float64)
    if not fixed.shape == var.shape == peak.shape or fixed.ndim != 1:
        raise ValueError(f"fixed_bytes, var_bytes and measured_peak_bytes must be equal-length lists, got "
                         f"{fixed.shape}, {var.shape}, {peak.shape}")
    for name, values in (("fixed_bytes", fixed), ("var_bytes", var)):
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    if not np.all(np.isfinite(peak)) or np.any(peak <= 0):
        raise ValueError("measured_peak_bytes must be finite and positive")
    if not (np.isfinite(prior) and prior > 0):
        raise ValueError(f"prior={prior} must be finite and positive")
    use = (var > 0) & (prior * var >= min_share * peak)
    ratios = (peak[use] - fixed[use]) / var[use]
    # not fitted: no usable step, or the fixed part alone is over every peak (nothing says what
    # a token costs)
    fitted = bool(ratios.size) and float(ratios.max()) > 0
    factor = float(ratios.max()) if fitted else prior

    def errors(a: float) -> tuple[float | None, float | None]:
        if not len(peak):
            return None, None
        pred = fixed + a * var
        return float(np.max(peak / pred - 1)), float(np.mean(np.abs(pred - peak) / peak))

    under_before, mape_before = errors(prior)
    under_after, mape_after = errors(factor)
    return MemoryFit(factor=factor, fitted=fitted, num_points=int(use.sum()), num_measured=len(peak),
                     max_under_before=under_before, max_under_after=under_after,
                     mape_before=mape_before, mape_after=mape_after)
