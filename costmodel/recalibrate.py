"""Online recalibration: per-term scale factors fitted on measured micro-batch times.

A micro-batch's predicted time (``CostModel.microbatch_time_s``) is linear in four groups of
coefficients, so it splits exactly into four terms:

* ``compute``: the dense work that grows with the tokens: per token (GEMMs, norms, MLP) and
  the head per token;
* ``attention``: the attention work, per pair (``s^2``, or spatial and temporal pairs);
* ``alltoall``: the all-to-all fits (latency and inverse bandwidth together);
* ``overhead``: the fixed costs: per call of a layer (launches, and the dense parts'
  efficiency term ``per_token * linear_half_tokens``), per sample, per micro-batch.

:func:`term_times_s` gives the three terms of one micro-batch, evaluated by the cost model
itself (each term is the difference its doubling makes), so they sum to the prediction.
:func:`fit_scales` fits one factor per term, ``measured ~ sum_k s_k * term_k``, robustly:
residuals are log ratios under a Huber loss (``scipy.optimize.least_squares(loss='huber')``,
started from the prior and from a linear fit, the lower cost kept),
so a straggler step moves the predictions by about ``huber_scale / num_points``, not by its own
error; a term with no signal in the data keeps its prior factor. Quality is the mean absolute
percentage error on held-out steps before (prior factors) and after. :func:`scale_file` writes
the factors into a new cost-model file (the attention half-performance length is a shape and
stays; the dense one is rescaled so that its fixed part follows ``overhead``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import least_squares, nnls

from costmodel.evaluate import CostModel
from costmodel.ring.layout import GroupLayout
from costmodel.schema import CostModelFile, LayerTimeTerms, LinkFit
from costmodel.specs import Sample

TERMS = ("compute", "attention", "alltoall", "overhead")
"""The terms a micro-batch's time splits into, in column order."""
PER_TOKEN_BYTES = ("bytes_per_token_layer_none", "bytes_per_token_layer_full", "working_bytes_per_token",
                   "transient_bytes_per_token", "head_transient_bytes_per_token",
                   "recomputed_layer_bytes_per_token", "alltoall_buffer_bytes_per_token",
                   "bytes_per_sample_layer_none")
"""The activation coefficients that ``TermScales.activation`` multiplies."""


@dataclass(kw_only=True, frozen=True, slots=True)
class TermScales:
    """One multiplicative factor per term (1 = the base file as it is)."""

    compute: float = 1.0
    """Factor on the dense work per token (layers and head)."""
    attention: float = 1.0
    """Factor on the attention work per pair."""
    alltoall: float = 1.0
    """Factor on the all-to-all times (latency times it, bandwidth divided by it)."""
    overhead: float = 1.0
    """Factor on the fixed costs (per layer call, per sample, per micro-batch)."""
    activation: float = 1.0
    """Factor on the memory a micro-batch needs per token (activations kept, working sets); not
    a time term: fitted from measured step peaks (:mod:`costmodel.recalibrate_memory`)."""

    def __post_init__(self) -> None:
        for name in (*TERMS, "activation"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"scale {name}={value} must be finite and positive")

    def as_array(self) -> NDArray[np.float64]:
        """The time factors in ``TERMS`` order."""
        return np.array([getattr(self, name) for name in TERMS], dtype=np.float64)

    def as_dict(self) -> dict[str, float]:
        """Every factor by name (the time terms and ``activation``)."""
        return {name: float(getattr(self, name)) for name in (*TERMS, "activation")}

    @classmethod
    def from_array(cls, values: Sequence[float] | NDArray[np.float64], *, activation: float = 1.0) -> TermScales:
        """Time factors in ``TERMS`` order, and the memory factor."""
        return cls(**{name: float(v) for name, v in zip(TERMS, values, strict=True)}, activation=activation)


def _scaled_terms(terms: LayerTimeTerms, scales: TermScales) -> LayerTimeTerms:
    pairs = {k: getattr(terms, k) * scales.attention
             for k in ("per_attn_pair", "per_spatial_pair", "per_temporal_pair")}
    fixed = {k: getattr(terms, k) * scales.overhead for k in ("per_sample", "per_call")}
    return terms.model_copy(update={"per_token": terms.per_token * scales.compute,
                                    "per_token_relayout": terms.per_token_relayout * scales.compute, **pairs, **fixed})


def scale_file(file: CostModelFile, scales: TermScales, *, new_id: str | None = None,
               note: str = "") -> CostModelFile:
    """The file with each term's coefficients multiplied by its factor (validated anew).

    Args:
        file: The base file.
        scales: Factors per term.
        new_id: Id of the new file (default: the base id).
        note: Appended to the file's notes.
    """
    c = file.compute
    compute = c.model_copy(update={
        "forward": _scaled_terms(c.forward, scales),
        "backward": _scaled_terms(c.backward, scales),
        "head_s_per_token": c.head_s_per_token * scales.compute,
        "microbatch_overhead_s": c.microbatch_overhead_s * scales.overhead,
        # per_token * linear_half_tokens is a fixed cost per call: it follows ``overhead``.
        "linear_half_tokens": c.linear_half_tokens * scales.overhead / scales.compute,
    })
    alltoall = [LinkFit.model_validate({**f.model_dump(), "alpha_s": f.alpha_s * scales.alltoall,
                                        "bytes_per_s": f.bytes_per_s / scales.alltoall})
                for f in file.comm.alltoall]
    data = file.model_dump(mode="json")
    data["compute"] = compute.model_dump(mode="json")
    for key in PER_TOKEN_BYTES:  # the bytes that grow with the tokens; the fixed ones stay
        if data["activation"].get(key) is not None:  # a fitted recomputed layer (None: the analytic form)
            data["activation"][key] = data["activation"][key] * scales.activation
    data["comm"]["alltoall"] = [f.model_dump(mode="json") for f in alltoall]
    data["id"] = new_id or file.id
    if note:
        data["notes"] = (file.notes + "; " if file.notes else "") + note
    return CostModelFile.model_validate(data)


class TermSplitter:
    """Splits micro-batch predictions of one cost model into its terms (reuse it: it holds the
    model with each term doubled)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._doubled = [CostModel(file=scale_file(model.file, TermScales(**{name: 2.0})),
                                   cluster=model.cluster) for name in TERMS]

    def __call__(self, samples: Sequence[Sample], *, group_size: int, recompute_layers: Sequence[int],
                 num_nodes: int | None = None, layout: GroupLayout | None = None) -> NDArray[np.float64]:
        """Seconds of one micro-batch per term (``TERMS`` order); under pure Ulysses they sum to its
        prediction (:meth:`split` gives the rest under a ring layout)."""
        return self.split(samples, group_size=group_size, recompute_layers=recompute_layers, num_nodes=num_nodes,
                          layout=layout)[0]

    def split(self, samples: Sequence[Sample], *, group_size: int, recompute_layers: Sequence[int],
              num_nodes: int | None = None, layout: GroupLayout | None = None
              ) -> tuple[NDArray[np.float64], float]:
        """``(terms, rest_s)`` of one micro-batch on its group's layout (``layout``: a Ulysses x ring
        group, :meth:`CostModel.place`; None: pure Ulysses): seconds per term, each the change of
        the prediction when that term doubles, and the rest of the prediction no term scales (the
        ring's point-to-point hops its attention does not hide; ~0 for pure Ulysses)."""
        kwargs = {"group_size": group_size, "recompute_layers": recompute_layers, "num_nodes": num_nodes,
                  "layout": layout}
        total = self.model.microbatch_time_s(samples, **kwargs)  # type: ignore[arg-type]
        terms = np.array([m.microbatch_time_s(samples, **kwargs) - total  # type: ignore[arg-type]
                          for m in self._doubled], dtype=np.float64)
        pure_ulysses = layout is None or layout.ring_degree == 1  # the terms are the whole prediction
        return terms, 0.0 if pure_ulysses else float(total - terms.sum())


def term_times_s(model: CostModel, samples: Sequence[Sample], *, group_size: int,
                 recompute_layers: Sequence[int], num_nodes: int | None = None) -> NDArray[np.float64]:
    """Seconds of one micro-batch per term (``TERMS`` order); they sum to its predicted time.

    (One-off form of :class:`TermSplitter`.)
    """
    return TermSplitter(model)(samples, group_size=group_size, recompute_layers=recompute_layers,
                               num_nodes=num_nodes)


@dataclass(kw_only=True, frozen=True, slots=True)
class FitQuality:
    """Prediction error of the prior and the fitted factors."""

    heldout_mape_before: float | None
    """MAPE of the prior factors on the held-out micro-batches (None: nothing held out)."""
    heldout_mape_after: float | None
    """MAPE of the fitted factors on the held-out micro-batches."""
    train_mape_before: float
    """MAPE of the prior factors on the micro-batches fitted."""
    train_mape_after: float
    """MAPE of the fitted factors on them."""
    num_points: int
    """Micro-batches fitted."""
    num_heldout: int
    """Micro-batches held out (every ``heldout_every``-th measured step)."""
    active_terms: tuple[str, ...] = field(default=())
    """Terms the data could move (the others kept their prior factor)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ScaleFit:
    """Fitted factors and their quality."""

    scales: TermScales
    """The factors fitted on the non-held-out steps."""
    quality: FitQuality
    """Errors before and after."""


def _mape(pred: NDArray[np.float64], measured: NDArray[np.float64]) -> float:
    return float(np.mean(np.abs(pred - measured) / measured)) if len(measured) else float("nan")


def fit_scales(terms_s: NDArray[np.float64], measured_s: NDArray[np.float64], *, steps: Sequence[int],
               prior: TermScales | None = None, heldout_every: int = 5, huber_scale: float = 0.05,
               prior_weight: float = 1e-4, fixed_s: NDArray[np.float64] | None = None) -> ScaleFit:
    """Fit one factor per term so that ``terms_s @ scales + fixed_s`` predicts ``measured_s``.

    Args:
        terms_s: ``(n, 3)`` seconds per micro-batch and term under the *base* file.
        measured_s: ``(n,)`` measured seconds (one value per micro-batch and group).
        steps: ``(n,)`` step of each micro-batch: every ``heldout_every``-th distinct step is held
            out (none when fewer than ``heldout_every`` steps).
        prior: Factors before this fit (default 1): the "before" of the quality, the value of
            terms without signal, and the centre of a weak prior.
        heldout_every: Hold-out period in steps.
        huber_scale: Log-ratio error past which a point's pull stops growing (0.05 = 5%).
        prior_weight: Weight of ``log(s / prior)`` per term, against 1 per point (conditioning).
        fixed_s: ``(n,)`` seconds of each micro-batch no term scales (``TermSplitter.split``'s rest:
            a ring's exposed hops); default none.

    Raises:
        ValueError: for shapes that do not agree, non-positive measurements, or no point to fit.
    """
    terms = np.asarray(terms_s, dtype=np.float64)
    measured = np.asarray(measured_s, dtype=np.float64)
    step_arr = np.asarray(steps, dtype=np.int64)
    if terms.ndim != 2 or terms.shape[1] != len(TERMS) or terms.shape[0] != measured.shape[0] != len(step_arr):
        raise ValueError(f"terms_s must be (n, {len(TERMS)}) with one measurement and step per row, got "
                         f"{terms.shape}, {measured.shape}, {step_arr.shape}")
    if not np.all(np.isfinite(measured)) or np.any(measured <= 0):
        raise ValueError("measured_s must be finite and positive")
    if not np.all(np.isfinite(terms)) or np.any(terms < 0):
        raise ValueError("terms_s must be finite and non-negative")
    fixed = np.zeros(len(measured)) if fixed_s is None else np.asarray(fixed_s, dtype=np.float64)
    if fixed.shape != measured.shape or not np.all(np.isfinite(fixed)):
        raise ValueError(f"fixed_s must be finite with one value per measurement, got shape {fixed.shape}")
    prior = prior or TermScales()
    distinct = np.unique(step_arr)
    held_steps = distinct[heldout_every - 1::heldout_every] if len(distinct) >= heldout_every else distinct[:0]
    held = np.isin(step_arr, held_steps)
    train = ~held
    if not np.any(train):
        raise ValueError("no measured micro-batch to fit")
    base = prior.as_array()
    share = (terms[train] * base).sum(axis=0) / max(float((terms[train] @ base).sum()), 1e-300)
    active = share > 1e-6
    x0 = np.log(base[active])
    t_train, m_train, f_train = terms[train], measured[train], fixed[train]

    def full(x: NDArray[np.float64]) -> NDArray[np.float64]:
        scales = base.copy()
        scales[active] = np.exp(x)
        return scales

    def residuals(x: NDArray[np.float64]) -> NDArray[np.float64]:
        pred = t_train @ full(x) + f_train
        data = np.log(np.maximum(pred, 1e-300)) - np.log(m_train)
        return np.concatenate([data, math.sqrt(prior_weight) * (x - x0)])

    fitted = base
    if np.any(active):
        # The objective is not convex in the factors: start from the prior and from the
        # non-negative least-squares solution in relative error (a zero there keeps the prior),
        # keep the lower cost.
        linear, _ = nnls(t_train[:, active] / m_train[:, None], 1.0 - f_train / m_train)
        starts = [x0, np.log(np.where(linear > 0, linear, base[active]))]
        best = min((least_squares(residuals, start, loss="huber", f_scale=huber_scale, method="trf")
                    for start in starts), key=lambda r: float(r.cost))
        fitted = full(best.x)
    quality = FitQuality(
        heldout_mape_before=_mape(terms[held] @ base + fixed[held], measured[held]) if np.any(held) else None,
        heldout_mape_after=_mape(terms[held] @ fitted + fixed[held], measured[held]) if np.any(held) else None,
        train_mape_before=_mape(t_train @ base + f_train, m_train),
        train_mape_after=_mape(t_train @ fitted + f_train, m_train),
        num_points=int(train.sum()), num_heldout=int(held.sum()),
        active_terms=tuple(name for name, a in zip(TERMS, active, strict=True) if a))
    return ScaleFit(scales=TermScales.from_array(fitted, activation=prior.activation), quality=quality)
