"""Per-term fitters of ``costmodel.fit``: compute time and the head; the shared fitting helpers.

Every fitter fits the functional form that ``costmodel.evaluate`` evaluates, in *relative* error
(every row divided by its measurement, so a 1 ms point weighs as much as a 1 s point), on a
seeded training split, and reports the mean absolute percentage error (MAPE) on the held-out
rest. numpy/scipy only: the service fits without torch.

* compute: a ``compute`` record of ``n`` layers, ``k`` of them recomputed, run as one rank of a
  group of ``d`` on samples ``i`` (``s_i`` tokens, ``f_i`` frames of ``hw_i``) is
  ``(n + k)*F + n*B + c`` with, per pass, ``F = per_token*T + sum_i attn_i + per_sample*S +
  per_call`` (``T`` the rank's tokens, ``S`` the samples), ``attn_i = pairs_i/d + h*pairs_i/s_i``
  (the attention efficiency ``n/(n + h)`` of ``n = s_i/d`` tokens per rank; ``pairs = s^2`` for
  1D, ``f*hw^2`` and ``hw*f^2`` for 2D) and ``c`` the micro-batch's fixed cost. The
  half-performance length ``h`` is the one nonlinear parameter: a bounded scalar search over
  ``h`` with non-negative least squares for the rest at each candidate. It is identified only by
  records at group sizes above 1 (at ``d = 1``, ``h*s`` is just more work per token).
  The dense parts' half-performance length is a cost per call that no profile can tell apart
  from launch overheads: it is fitted as ``per_call`` (``linear_half_tokens`` stays 0).
* activation and peak bytes, the head's transient bytes: :mod:`costmodel.fit_memory`.
* head: time ``head_s_per_token * T + c_head``; bytes ``working * T``.
* collectives: :mod:`costmodel.fit_comm`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import minimize_scalar, nnls

from costmodel.model_terms import KIND_TERMS
from costmodel.profiling.format import CommRecord, ComputeRecord, HeadRecord
from costmodel.schema import LayerTimeTerms, TermFit

FloatArray = NDArray[np.float64]
TimeStatistic = Literal["median", "min"]


@dataclass(frozen=True, slots=True)
class TermResult:
    """Fit of one term: its held-out predictions and error."""

    name: str
    mape: float
    num_points: int
    num_heldout: int
    heldout_measured: FloatArray = field(repr=False)
    heldout_predicted: FloatArray = field(repr=False)
    heldout_index: tuple[int, ...] = ()
    """Positions of the held-out points in the records the term was fitted to."""
    measured: FloatArray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Every point's measurement, in the order of the records (training and held-out)."""
    predicted: FloatArray = field(default_factory=lambda: np.zeros(0), repr=False)
    """Every point's prediction by the fit of the training points (what ``costmodel.fit_diagnosis``
    looks for structure in)."""

    @property
    def worst_underprediction(self) -> float:
        """The largest ``measured / predicted - 1`` over the held-out points (0 when none is under)."""
        if len(self.heldout_measured) == 0:
            return 0.0
        ratio = self.heldout_measured / np.maximum(self.heldout_predicted, 1e-30) - 1.0
        return float(max(0.0, ratio.max()))

    def to_term_fit(self) -> TermFit:
        """The schema's record of this term."""
        return TermFit(mape=self.mape, num_points=self.num_points, num_heldout=self.num_heldout)


@dataclass(kw_only=True, frozen=True, slots=True)
class SplitConfig:
    """How a term is split and timed."""

    holdout_fraction: float
    """Share of the points held out."""
    seed: int
    """Seed of the split."""
    time_statistic: TimeStatistic
    """Median of the repeats, or the fastest."""


# ------------------------------------------------------------------------------------ helpers
def relative_nnls(a: FloatArray, y: FloatArray) -> FloatArray:
    """Non-negative ``x`` minimising ``sum(((a @ x - y) / y)^2)``.

    Raises:
        ValueError: when a measurement is not positive.
    """
    if np.any(y <= 0):
        raise ValueError(f"measurements must be positive, got min {float(y.min())}")
    rel = a / y[:, None]
    scale = np.linalg.norm(rel, axis=0)
    scale[scale == 0] = 1.0
    sol, _ = nnls(rel / scale, np.ones_like(y), maxiter=50 * a.shape[1])
    return np.asarray(sol / scale, dtype=np.float64)


def mape(measured: FloatArray, predicted: FloatArray) -> float:
    """Mean absolute percentage error (0.03 = 3%)."""
    return float(np.mean(np.abs(predicted - measured) / measured))


def split_indices(num: int, *, fraction: float, min_train: int, seed: int, term: str
                  ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Random train / held-out split with at least ``min_train`` training and one held-out point.

    Raises:
        ValueError: naming the term when there are too few points.
    """
    if num < min_train + 1:
        raise ValueError(
            f"too few points for {term}: {num} points, need at least {min_train + 1} "
            f"({min_train} to fit its unknowns and one to validate)"
        )
    num_held = min(max(1, round(fraction * num)), num - min_train)
    order = np.random.default_rng(seed).permutation(num)
    return np.sort(order[num_held:]), np.sort(order[:num_held])


def _check_rank(name: str, a: FloatArray, hint: str) -> None:
    num_unknowns = a.shape[1]
    rank = np.linalg.matrix_rank(a / np.maximum(np.linalg.norm(a, axis=0), 1e-300))
    if rank < num_unknowns:
        raise ValueError(f"too few distinct points for {name}: the training points determine {rank} "
                         f"of {num_unknowns} unknowns ({hint})")


def fit_linear_term(name: str, a: FloatArray, y: FloatArray, split: SplitConfig, *,
                    hint: str = "vary token counts, packings, layer counts and policies"
                    ) -> tuple[FloatArray, TermResult]:
    """Fit ``a @ x ~ y`` on a training split; report MAPE on the held-out split."""
    train, held = split_indices(len(y), fraction=split.holdout_fraction, min_train=a.shape[1] + 1,
                                seed=split.seed, term=name)
    _check_rank(name, a[train], hint)
    x = relative_nnls(a[train], y[train])
    return x, term_result(name, y, a @ x, train=train, held=held)


def term_result(name: str, measured: FloatArray, predicted: FloatArray, *, train: NDArray[np.int64],
                held: NDArray[np.int64]) -> TermResult:
    """The result of a term from every point's measurement and prediction and the split."""
    return TermResult(name, mape(measured[held], predicted[held]), len(train), len(held), measured[held],
                      predicted[held], tuple(int(i) for i in held), measured=measured, predicted=predicted)


def timing(rec: ComputeRecord | HeadRecord | CommRecord, statistic: TimeStatistic) -> float:
    """The record's time under the chosen statistic."""
    return rec.time_s if statistic == "median" else rec.time_s_min


# ------------------------------------------------------------------------------------ compute
@dataclass(frozen=True, slots=True)
class ComputeFit:
    """Result of :func:`fit_compute`."""

    forward: LayerTimeTerms
    backward: LayerTimeTerms
    attention_half_tokens: float
    fixed_s: float
    """The micro-batch's fixed cost outside the layers (``c``)."""
    result: TermResult


def _whole(kind: str) -> bool:
    """True for kinds whose attention runs over a sample's whole sequence (pairs ``s^2``,
    ``s = f*hw``: 1d, 3d); 2d attends spatially and temporally (``costmodel.model_terms``)."""
    return KIND_TERMS[kind].attention == "whole"


def _pair_columns(rec: ComputeRecord, kind: str, half: float) -> list[float]:
    d = rec.group_size
    cols: list[float] = []
    if _whole(kind):
        cols.append(sum(float(f * hw) ** 2 / d + half * f * hw for f, hw in rec.samples))
    else:
        cols.append(sum(f * float(hw) ** 2 / d + half * hw for f, hw in rec.samples))
        cols.append(sum(hw * float(f) ** 2 / d + half * f for f, hw in rec.samples))
    return cols


def _compute_rows(records: Sequence[ComputeRecord], kind: str, half: float, per_call: bool,
                  relayout: bool) -> FloatArray:
    rows = []
    for rec in records:
        per_pass = [float(rec.tokens_per_rank), *_pair_columns(rec, kind, half), float(len(rec.samples))]
        if per_call:
            per_pass.append(1.0)
        x = np.array(per_pass, dtype=np.float64)
        n, k = rec.num_layers, rec.recompute_layers
        # the re-layout around attention (groups of 2 or more only) moves the same bytes in a
        # forward and a backward pass: one coefficient for both
        moved = [(2 * n + k) * float(rec.tokens_per_rank) * (rec.group_size > 1)] if relayout else []
        rows.append(np.concatenate([(n + k) * x, n * x, moved, [1.0]]))
    return np.array(rows, dtype=np.float64)


def _terms(part: FloatArray, kind: str, per_call: bool, moved: float) -> LayerTimeTerms:
    call = float(part[-1]) if per_call else 0.0
    if _whole(kind):
        return LayerTimeTerms(per_token=part[0], per_attn_pair=part[1], per_sample=part[2], per_call=call,
                              per_token_relayout=moved)
    return LayerTimeTerms(per_token=part[0], per_spatial_pair=part[1], per_temporal_pair=part[2],
                          per_sample=part[3], per_call=call, per_token_relayout=moved)


def fit_compute(records: Sequence[ComputeRecord], kind: str, split: SplitConfig, *,
                attention_half_tokens: float | None = None) -> ComputeFit:
    """Forward and backward per-layer terms, the attention half-performance length, the fixed cost.

    Args:
        records: The compute records.
        kind: ``1d``, ``2d`` or ``3d`` (3d: whole-clip attention, as 1d over ``f*hw`` tokens).
        split: Hold-out split and timing statistic.
        attention_half_tokens: Fix the half-performance length instead of fitting it.

    Raises:
        ValueError: naming the records that are missing to identify a term.
    """
    if not records:
        raise ValueError("too few points for compute_time: the profile has no compute records")
    if not any(r.recompute_layers > 0 for r in records) or not any(r.recompute_layers == 0 for r in records):
        raise ValueError(
            "too few points for compute_time: need records with and without checkpointed layers "
            "to separate forward from backward"
        )
    if attention_half_tokens is None and all(r.group_size == 1 for r in records):
        raise ValueError(
            "attention_half_tokens cannot be identified: every compute record has group_size 1 "
            "(a dcp-profile/1 file, or a sweep without --group-sizes); profile again with group "
            "sizes above 1 (dcp profile --group-sizes 1,2,4, format dcp-profile/2 or later) or fix it "
            "(dcp fit --attention-half-tokens VALUE)"
        )
    per_call = len({r.num_layers for r in records}) > 1
    relayout = any(r.group_size > 1 for r in records) and any(r.group_size == 1 for r in records)
    y = np.array([timing(r, split.time_statistic) for r in records], dtype=np.float64)
    width = _compute_rows(records, kind, 0.0, per_call, relayout).shape[1]
    train, held = split_indices(len(y), fraction=split.holdout_fraction, min_train=width + 1,
                                seed=split.seed, term="compute_time")
    hint = "vary token counts, packings, layer counts, policies and group sizes"
    _check_rank("compute_time", _compute_rows([records[i] for i in train], kind, 1.0, per_call, relayout), hint)

    def loss(half: float) -> float:
        a = _compute_rows([records[i] for i in train], kind, half, per_call, relayout)
        x = relative_nnls(a, y[train])
        return float(np.sum(((a @ x - y[train]) / y[train]) ** 2))

    if attention_half_tokens is not None:
        half = float(attention_half_tokens)
    else:
        half = _search_half(loss, upper=8.0 * max(r.num_tokens for r in records))
    a = _compute_rows(records, kind, half, per_call, relayout)
    theta = relative_nnls(a[train], y[train])
    result = term_result("compute_time", y, a @ theta, train=train, held=held)
    m = (a.shape[1] - 1 - relayout) // 2
    moved = float(theta[2 * m]) if relayout else 0.0
    return ComputeFit(forward=_terms(theta[:m], kind, per_call, moved),
                      backward=_terms(theta[m:2 * m], kind, per_call, moved),
                      attention_half_tokens=half, fixed_s=float(theta[-1]), result=result)


def _search_half(loss: Callable[[float], float], *, upper: float) -> float:
    """Minimise ``loss`` over ``[0, upper]``: a log grid, then a bounded search around its best."""
    grid = np.concatenate([[0.0], np.geomspace(1.0, max(upper, 2.0), 48)])
    values = [loss(float(h)) for h in grid]
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    if hi <= lo:
        return float(grid[best])
    found = minimize_scalar(loss, bounds=(float(lo), float(hi)), method="bounded",
                            options={"xatol": 1e-3 * max(float(hi), 1.0)})
    return float(found.x) if float(found.fun) <= values[best] else float(grid[best])


# ------------------------------------------------------------------------------------ head
def fit_head(records: Sequence[HeadRecord], split: SplitConfig) -> tuple[float, float, float, TermResult]:
    """``(s per token, fixed s, bytes per token, result)`` of the head."""
    a = np.array([[r.tokens, 1.0] for r in records], dtype=np.float64)
    y = np.array([timing(r, split.time_statistic) for r in records], dtype=np.float64)
    coef, result = fit_linear_term("head_time", a, y, split)
    tokens = np.array([r.tokens for r in records], dtype=np.float64)
    act = np.array([r.activation_bytes for r in records], dtype=np.float64)
    bytes_per_token = float(np.median(act / tokens))
    return float(coef[0]), float(coef[1]), bytes_per_token, result
