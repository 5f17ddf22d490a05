"""Why a term's error is high: noise, or the model's form (structural error).

Noise leaves residuals with no structure. A wrong or missing term of the form (structural
error) leaves residuals that follow the records: correlated with the checkpoint policy, the
group size, the depth or the tokens, or running in long stretches of one sign along the tokens.
The refusal of ``dcp fit`` says which, because the fixes differ (more repeats and a quieter
machine, or another profile or model).

Two tests on the relative residuals ``predicted / measured - 1`` of every record (each
predicted by the fit of the training points):

* a regression F-test: the residuals against the policy (none / selective / full), the group
  size and the depth (each a category) and ``log T``, ``(log T)^2`` of the tokens per rank; each
  factor also by itself (a partial F-test), to name it;
* a runs test (Wald-Wolfowitz) on the residuals' signs, ordered by policy, group size, depth and
  tokens: a misfit that varies smoothly with the tokens gives few long runs.

Structural when either p-value is below ``ALPHA``. Noise-free residuals of a misfit are a
function of the records, so a regression on the records' factors explains them (F grows without
bound) or their signs run in stretches: a noise-free profile with a structural misfit is never
called noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray
from scipy.stats import f as f_dist
from scipy.stats import norm

from costmodel.fit_terms import TermResult
from costmodel.profiling.format import ComputeRecord

ALPHA = 0.001
"""A p-value below this calls the residuals structured (each of the two tests)."""
EXACT = 1e-9
"""Residuals all below this (relative): the fit is exact, there is nothing to diagnose."""
MIN_POINTS = 8
"""Fewer records than this: too few to tell (``unknown``)."""
FloatArray = NDArray[np.float64]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordFactors:
    """What each record of a term was measured at (in the order of the records)."""

    policy: Sequence[str]
    """``none``, ``selective`` or ``full``."""
    group_size: Sequence[int]
    """Ranks of the group."""
    depth: Sequence[int]
    """Layers run."""
    tokens: Sequence[float]
    """Tokens per rank."""

    @classmethod
    def of_compute(cls, records: Sequence[ComputeRecord]) -> RecordFactors:
        """The factors of compute records."""
        def policy(n: int, k: int) -> str:
            return "none" if k == 0 else "full" if k == n else "selective"

        return cls(policy=[policy(r.num_layers, r.recompute_layers) for r in records],
                   group_size=[r.group_size for r in records], depth=[r.num_layers for r in records],
                   tokens=[float(r.tokens_per_rank) for r in records])


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """The verdict on one term's residuals."""

    kind: str
    """``model-form`` (structural), ``noise``, ``exact`` (residuals at rounding level) or
    ``unknown`` (too few records)."""
    p_regression: float
    """p-value of the residuals' regression on the records' factors (1.0 when not tested)."""
    p_runs: float
    """p-value of the runs test on their signs (1.0 when not tested)."""
    factors: tuple[tuple[str, float, str], ...] = ()
    """The factors the residuals follow: ``(name, partial p-value, what they do)``, strongest first."""

    def describe(self) -> str:
        """One line for the refusal message and the file's notes."""
        if self.kind == "unknown":
            return "too few records to tell noise from the model's form"
        if self.kind == "exact":
            return "exact (every residual below 1e-9)"
        if self.kind == "noise":
            return (f"looks like noise: the residuals follow no policy, group size, depth or token count "
                    f"(regression p={self.p_regression:.2g}, runs p={self.p_runs:.2g})")
        found = "; ".join(f"{name} ({what}, p={p:.1g})" for name, p, what in self.factors[:3])
        runs = f"signs run in stretches along the tokens (p={self.p_runs:.1g})" if self.p_runs < ALPHA else ""
        listing = "; ".join(x for x in (found, runs) if x) or f"regression p={self.p_regression:.1g}"
        return f"a model-form error, not noise: the residuals follow {listing}; more repeats will not fix it"


def _categories(values: Sequence[object]) -> FloatArray:
    """Indicator columns of a category, the first level dropped (empty for a single level)."""
    levels = sorted(set(values), key=str)
    return np.array([[float(v == level) for level in levels[1:]] for v in values], dtype=np.float64).reshape(
        len(values), max(len(levels) - 1, 0))


def _sse(design: FloatArray, y: FloatArray) -> tuple[float, int]:
    """Residual sum of squares of the least-squares fit and the design's rank."""
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    return float(resid @ resid), int(np.linalg.matrix_rank(design))


def _f_test(full: FloatArray, reduced: FloatArray, y: FloatArray) -> float:
    """p-value that the columns of ``full`` beyond ``reduced`` explain nothing."""
    sse_full, rank_full = _sse(full, y)
    sse_red, rank_red = _sse(reduced, y)
    extra, dof = rank_full - rank_red, len(y) - rank_full
    if extra <= 0 or dof <= 0:
        return 1.0
    scale = float(y @ y) or 1.0
    if sse_full <= 1e-24 * scale:  # explained exactly (noise-free): structure, if the extra columns did it
        return 0.0 if sse_red > 1e-20 * scale else 1.0
    return float(f_dist.sf(((sse_red - sse_full) / extra) / (sse_full / dof), extra, dof))


def _runs_p(signs: NDArray[np.bool_]) -> float:
    """One-sided p-value of the Wald-Wolfowitz runs test (too few runs)."""
    n1, n2 = int(signs.sum()), int((~signs).sum())
    if n1 == 0 or n2 == 0:
        return 0.0 if len(signs) >= MIN_POINTS else 1.0  # every residual of one sign
    runs = 1 + int(np.count_nonzero(signs[1:] != signs[:-1]))
    n = n1 + n2
    mean = 2.0 * n1 * n2 / n + 1.0
    var = 2.0 * n1 * n2 * (2.0 * n1 * n2 - n) / (n * n * (n - 1.0))
    if var <= 0:
        return 1.0
    return float(norm.cdf((runs - mean) / np.sqrt(var)))


def diagnose(term: TermResult, factors: RecordFactors) -> Diagnosis:
    """The diagnosis of ``term``'s residuals over every record it was fitted to."""
    measured, predicted = term.measured, term.predicted
    if len(measured) < MIN_POINTS or len(measured) != len(factors.tokens):
        return Diagnosis(kind="unknown", p_regression=1.0, p_runs=1.0)
    resid = predicted / measured - 1.0
    if float(np.max(np.abs(resid))) <= EXACT:
        return Diagnosis(kind="exact", p_regression=1.0, p_runs=1.0)
    log_t = np.log(np.asarray(factors.tokens, dtype=np.float64))
    log_t = (log_t - log_t.mean()) / (log_t.std() or 1.0)
    columns = {
        "policy": _categories(factors.policy),
        "group size": _categories(factors.group_size),
        "depth": _categories(factors.depth),
        "tokens": np.stack([log_t, log_t ** 2], axis=1),
    }
    ones = np.ones((len(resid), 1))
    full = np.hstack([ones, *columns.values()])
    p_regression = _f_test(full, ones, resid)
    found = []
    for name, cols in columns.items():
        if cols.shape[1] == 0:
            continue
        others = np.hstack([ones, *(c for n, c in columns.items() if n != name)])
        p = _f_test(full, others, resid)
        if p < ALPHA:
            found.append((name, p, _what(name, factors, resid)))
    order = np.lexsort((factors.tokens, factors.depth, factors.group_size, factors.policy))
    p_runs = _runs_p(resid[order] > 0)
    form = p_regression < ALPHA or p_runs < ALPHA
    return Diagnosis(kind="model-form" if form else "noise", p_regression=p_regression, p_runs=p_runs,
                     factors=tuple(sorted(found, key=lambda f: f[1])))


def _what(name: str, factors: RecordFactors, resid: FloatArray) -> str:
    """How the residuals follow one factor: mean residual per level, or their correlation."""
    if name == "tokens":
        r = float(np.corrcoef(np.log(np.asarray(factors.tokens, dtype=np.float64)), resid)[0, 1])
        return f"correlation {r:+.2f} with log tokens"
    values = {"policy": factors.policy, "group size": factors.group_size, "depth": factors.depth}[name]
    levels = sorted(set(values), key=str)
    means = [(level, float(np.mean([r for v, r in zip(values, resid, strict=True) if v == level])))
             for level in levels]
    return ", ".join(f"{level} {mean:+.1%}" for level, mean in means)
