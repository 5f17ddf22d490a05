"""Fit a cost-model file to profiles (numpy/scipy only: the service can fit without torch).

The functional forms are those of ``costmodel.schema`` / DESIGN.md, fitted by non-negative
least squares in *relative* error (every row divided by its measurement, so a 1 ms point
weighs as much as a 1 s point):

* compute: a ``compute`` record of ``n`` layers, ``k`` of them recomputed, on samples ``i`` is
  ``n*(F + B) + k*F + c`` where ``F = sum_i fwd.x_i + u_f`` and ``B = sum_i bwd.x_i + u_b``,
  ``x_i = (s_i, s_i^2 | f_i*hw_i^2, hw_i*f_i^2, 1)`` (tokens, attention pairs, per sample),
  ``u_f``/``u_b`` are per-layer costs of a micro-batch and ``c`` the micro-batch's fixed cost.
  Several ``k`` separate forward from backward; several ``n`` separate ``u`` from ``c``.
* activation bytes: ``S * ((n - k)*none + k*full)`` for ``S`` tokens.
* head: time ``head_s_per_token * S + c_head``; bytes ``working * S``.
* collectives: per op, placement and group size, ``alpha + x / bandwidth`` with
  ``x = bytes*(d-1)/d`` (all-to-all) or ``2*bytes*(d-1)/d`` (ring all-reduce), exactly the
  forms ``costmodel.evaluate`` uses.

A share of the points is held out; each term's mean absolute percentage error (MAPE) on the
held-out points is recorded in ``fit_quality``. A term worse than ``max_mape`` is refused
(``FitRefusedError``) unless ``force`` is set. A profile of a narrower/shallower shape than the
full model is scaled to it: per-layer terms apply to every layer of the full model, and width
changes are scaled by the analytic FLOP and byte ratios of ``costmodel.analytic`` (noted).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import nnls

from costmodel.analytic import (
    AnalyticConfig,
    activation_bytes_per_token_layer,
    alltoall_bytes_per_token_layer,
    analytic_cost_model,
    attention_flops_per_pair,
    linear_flops_per_token_layer,
    num_params,
)
from costmodel.presets import load_hardware
from costmodel.profiling.format import CommRecord, ComputeRecord, HeadRecord, Profile, ProfileHeader
from costmodel.schema import (
    ActivationCoefficients,
    CommCoefficients,
    ComputeCoefficients,
    CostModelFile,
    LayerTimeTerms,
    LinkFit,
    TermFit,
)
from costmodel.specs import ModelSpec

logger = logging.getLogger(__name__)

FloatArray = NDArray[np.float64]
TERM_NAMES = ("compute_time", "activation_bytes", "head_time", "alltoall", "allreduce")
_MIN_BANDWIDTH_BYTES_PER_S = 1e-30  # floor for 1/bandwidth; keeps bytes_per_s finite


class FitRefusedError(ValueError):
    """A term's held-out error exceeds the limit (the message names the terms)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class FitConfig:
    """How to fit."""

    holdout_fraction: float = 0.25
    """Share of each term's points held out to measure MAPE."""
    max_mape: float = 0.10
    """Refuse a fit whose held-out MAPE on any term exceeds this (0.10 = 10%)."""
    force: bool = False
    """Write the fit even above ``max_mape`` (recorded in the notes)."""
    time_statistic: Literal["median", "min"] = "median"
    """Which timing to fit: the median of the repeats, or the fastest (robust on a busy machine)."""
    seed: int = 0
    """Seed of the hold-out split."""
    model_id: str | None = None
    """Id of the output file; default ``fitted-<model>-<hardware>``."""
    comm_fallback_hardware: str | None = None
    """Hardware preset whose analytic links fill in unmeasured collectives (default: the
    profile's hardware when it is a preset)."""

    def __post_init__(self) -> None:
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.max_mape <= 0:
            raise ValueError(f"max_mape must be positive, got {self.max_mape}")


@dataclass(frozen=True, slots=True)
class TermResult:
    """Fit of one term: its held-out predictions and error."""

    name: str
    mape: float
    num_points: int
    num_heldout: int
    heldout_measured: FloatArray = field(repr=False)
    heldout_predicted: FloatArray = field(repr=False)

    def to_term_fit(self) -> TermFit:
        """The schema's record of this term."""
        return TermFit(mape=self.mape, num_points=self.num_points, num_heldout=self.num_heldout)


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted file and the per-term results behind it."""

    file: CostModelFile
    terms: dict[str, TermResult]


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


def _fit_term(name: str, a: FloatArray, y: FloatArray, config: FitConfig
              ) -> tuple[FloatArray, TermResult]:
    """Fit ``a @ x ~ y`` on a training split; report MAPE on the held-out split."""
    num_unknowns = a.shape[1]
    train, held = split_indices(len(y), fraction=config.holdout_fraction, min_train=num_unknowns + 1,
                                seed=config.seed, term=name)
    rank = np.linalg.matrix_rank(a[train] / np.maximum(np.linalg.norm(a[train], axis=0), 1e-300))
    if rank < num_unknowns:
        raise ValueError(
            f"too few distinct points for {name}: the training points determine {rank} of "
            f"{num_unknowns} unknowns (vary token counts, packings, layer counts and policies)"
        )
    x = relative_nnls(a[train], y[train])
    pred = a[held] @ x
    result = TermResult(name, mape(y[held], pred), len(train), len(held), y[held], pred)
    return x, result


# ------------------------------------------------------------------------------------ compute
def _sample_features(rec: ComputeRecord, kind: str) -> FloatArray:
    """Per-layer features summed over the samples: tokens, pair terms, samples."""
    tok = sum(f * hw for f, hw in rec.samples)
    if kind == "1d":
        pairs = [sum(float(hw) ** 2 for _, hw in rec.samples)]
    else:
        pairs = [sum(f * float(hw) ** 2 for f, hw in rec.samples),
                 sum(hw * float(f) ** 2 for f, hw in rec.samples)]
    return np.array([tok, *pairs, len(rec.samples)], dtype=np.float64)


def _timing(rec: ComputeRecord | HeadRecord | CommRecord, config: FitConfig) -> float:
    return rec.time_s if config.time_statistic == "median" else rec.time_s_min


def fit_compute(records: Sequence[ComputeRecord], kind: str, config: FitConfig
                ) -> tuple[LayerTimeTerms, LayerTimeTerms, float, float, TermResult]:
    """Forward and backward per-layer terms, per-layer and fixed micro-batch costs.

    Returns:
        ``(forward, backward, per_layer_microbatch_s, fixed_microbatch_s, result)``.
    """
    if not records:
        raise ValueError("too few points for compute_time: the profile has no compute records")
    if not any(r.recompute_layers > 0 for r in records) or not any(r.recompute_layers == 0 for r in records):
        raise ValueError(
            "too few points for compute_time: need records with and without checkpointed layers "
            "to separate forward from backward"
        )
    separate_layers = len({r.num_layers for r in records}) > 1
    rows, y = [], []
    for rec in records:
        x = _sample_features(rec, kind)
        n, k = rec.num_layers, rec.recompute_layers
        fwd = np.append(x, 1.0) if separate_layers else x
        bwd = fwd
        # unknowns: forward terms (+ u_f), backward terms (+ u_b), fixed c
        rows.append(np.concatenate([(n + k) * fwd, n * bwd, [1.0]]))
        y.append(_timing(rec, config))
    theta, result = _fit_term("compute_time", np.array(rows), np.array(y), config)
    m = len(x) + (1 if separate_layers else 0)
    f_part, b_part, fixed = theta[:m], theta[m:2 * m], float(theta[-1])
    per_layer = float(f_part[-1] + b_part[-1]) if separate_layers else 0.0

    def terms(part: FloatArray) -> LayerTimeTerms:
        if kind == "1d":
            return LayerTimeTerms(per_token=part[0], per_attn_pair=part[1], per_sample=part[2])
        return LayerTimeTerms(per_token=part[0], per_spatial_pair=part[1], per_temporal_pair=part[2],
                              per_sample=part[3])

    return terms(f_part), terms(b_part), per_layer, fixed, result


def fit_activation(records: Sequence[ComputeRecord], config: FitConfig
                   ) -> tuple[float, float, TermResult]:
    """``(none, full)`` bytes per token per layer."""
    if not any(r.recompute_layers > 0 for r in records) or not any(
            r.recompute_layers < r.num_layers for r in records):
        raise ValueError(
            "too few points for activation_bytes: need records with and without checkpointed layers"
        )
    a = np.array([[r.num_tokens * (r.num_layers - r.recompute_layers), r.num_tokens * r.recompute_layers]
                  for r in records], dtype=np.float64)
    y = np.array([r.activation_bytes for r in records], dtype=np.float64)
    if np.any(y <= 0):
        raise ValueError("activation_bytes must be positive in every compute record")
    coef, result = _fit_term("activation_bytes", a, y, config)
    return float(coef[0]), float(coef[1]), result


def fit_head(records: Sequence[HeadRecord], config: FitConfig
             ) -> tuple[float, float, float, TermResult]:
    """``(s per token, fixed s, bytes per token, result)`` of the head."""
    a = np.array([[r.tokens, 1.0] for r in records], dtype=np.float64)
    y = np.array([_timing(r, config) for r in records], dtype=np.float64)
    coef, result = _fit_term("head_time", a, y, config)
    tokens = np.array([r.tokens for r in records], dtype=np.float64)
    act = np.array([r.activation_bytes for r in records], dtype=np.float64)
    bytes_per_token = float(np.median(act / tokens))
    return float(coef[0]), float(coef[1]), bytes_per_token, result


# ------------------------------------------------------------------------------------ comm
def comm_feature(op: str, bytes_per_rank: float, group_size: int) -> float:
    """Bytes on the wire per rank, as ``costmodel.evaluate`` models each collective."""
    share = (group_size - 1) / group_size
    return bytes_per_rank * share * (2.0 if op == "allreduce" else 1.0)


def fit_comm(records: Sequence[CommRecord], config: FitConfig
             ) -> tuple[dict[str, list[LinkFit]], dict[str, TermResult]]:
    """Alpha-beta per op, placement and group size; MAPE per op over all its groups."""
    fits: dict[str, list[LinkFit]] = {"alltoall": [], "allreduce": []}
    results: dict[str, TermResult] = {}
    for op in ("alltoall", "allreduce"):
        recs = [r for r in records if r.op == op]
        keys = sorted({(r.placement, r.group_size) for r in recs})
        measured, predicted, num_train = [], [], 0
        for placement, d in keys:
            group = [r for r in recs if (r.placement, r.group_size) == (placement, d)]
            a = np.array([[1.0, comm_feature(op, r.bytes_per_rank, d)] for r in group])
            y = np.array([_timing(r, config) for r in group])
            coef, res = _fit_term(f"{op} ({placement}, group size {d})", a, y, config)
            inv_bw = max(float(coef[1]), _MIN_BANDWIDTH_BYTES_PER_S)
            fits[op].append(LinkFit(placement=placement, group_size=d, alpha_s=float(coef[0]),
                                    bytes_per_s=1.0 / inv_bw))
            measured.append(res.heldout_measured)
            predicted.append(res.heldout_predicted)
            num_train += res.num_points
        if keys:
            m, p = np.concatenate(measured), np.concatenate(predicted)
            results[op] = TermResult(op, mape(m, p), num_train, len(m), m, p)
    return fits, results


# ------------------------------------------------------------------------------------ assemble
def _ratio(full: float, profiled: float) -> float:
    return full / profiled if profiled > 0 else 1.0


def _scale_terms(t: LayerTimeTerms, *, token: float, pair: float) -> LayerTimeTerms:
    return LayerTimeTerms(per_token=t.per_token * token, per_attn_pair=t.per_attn_pair * pair,
                          per_spatial_pair=t.per_spatial_pair * pair,
                          per_temporal_pair=t.per_temporal_pair * pair, per_sample=t.per_sample)


def _merge_headers(profiles: Sequence[Profile]) -> tuple[ProfileHeader, ModelSpec, ModelSpec]:
    compute_headers = [p.header for p in profiles if p.header.model is not None]
    if not compute_headers:
        raise ValueError("no compute profile: give a profile made by `dcp profile`")
    first = compute_headers[0]
    hardware = {p.header.hardware for p in profiles}
    if len(hardware) > 1:
        raise ValueError(f"profiles are for different hardware: {sorted(hardware)}")
    for h in compute_headers[1:]:
        if h.model != first.model or h.profiled != first.profiled or h.dtype != first.dtype:
            raise ValueError("compute profiles disagree on model, profiled shape or dtype")
    assert first.model is not None and first.profiled is not None
    return first, first.model, first.profiled


def fit_profiles(profiles: Sequence[Profile], config: FitConfig | None = None) -> FitResult:
    """Fit a cost-model file to one compute profile (and optionally communication profiles).

    Args:
        profiles: Parsed profiles; compute and head records must come from one model shape,
            comm records from any number of ``dcp profile-comm`` runs on the same hardware.
        config: Fit options.

    Returns:
        The fitted ``CostModelFile`` (provenance ``fitted``, ``fit_quality`` per term) and the
        per-term results.

    Raises:
        ValueError: for a bad or insufficient profile (naming the term and the reason).
        FitRefusedError: when a term's held-out MAPE exceeds ``config.max_mape`` without force.
    """
    cfg = config or FitConfig()
    header, model, profiled = _merge_headers(profiles)
    compute = [r for p in profiles for r in p.compute]
    heads = [r for p in profiles for r in p.head]
    comm = [r for p in profiles for r in p.comm]
    fwd, bwd, per_layer_s, fixed_s, compute_res = fit_compute(compute, model.kind, cfg)
    none_b, full_b, act_res = fit_activation(compute, cfg)
    terms = {"compute_time": compute_res, "activation_bytes": act_res}
    head_s, head_fixed_s, head_bytes = 0.0, 0.0, 0.0
    if heads:
        head_s, head_fixed_s, head_bytes, terms["head_time"] = fit_head(heads, cfg)
    notes = [f"fitted to {len(compute)} compute, {len(heads)} head and {len(comm)} comm records "
             f"({header.device} {header.device_name!r}, {header.dtype}, timer "
             f"{header.timer or 'unstated'}, statistic {cfg.time_statistic})",
             f"profiled shape: {profiled.num_layers} layers, hidden {profiled.hidden}, "
             f"heads {profiled.num_heads}, ffn {profiled.ffn_hidden}, vocab {profiled.vocab}, "
             f"text tokens {profiled.cross_attention_tokens}"]
    # Width scaling by analytic FLOP and byte ratios (identity when the width is the model's).
    token_r = _ratio(linear_flops_per_token_layer(model), linear_flops_per_token_layer(profiled))
    pair_r = _ratio(attention_flops_per_pair(model), attention_flops_per_pair(profiled))
    none_full, full_full = activation_bytes_per_token_layer(model)
    none_prof, full_prof = activation_bytes_per_token_layer(profiled)
    if model.kind == "1d":
        head_r = _ratio(model.hidden * model.vocab, profiled.hidden * profiled.vocab)
        head_bytes_r = _ratio(model.vocab + model.hidden, profiled.vocab + profiled.hidden)
    else:
        head_r = head_bytes_r = _ratio(model.hidden, profiled.hidden)
    scaled = any(abs(r - 1) > 1e-12 for r in (token_r, pair_r, head_r))
    if scaled:
        notes.append(f"scaled to the full width by analytic ratios: per token x{token_r:.4g}, "
                     f"per pair x{pair_r:.4g}, head x{head_r:.4g}; fit_quality is for the "
                     "profiled shape")
    fwd = _scale_terms(fwd, token=token_r, pair=pair_r)
    bwd = _scale_terms(bwd, token=token_r, pair=pair_r)
    dtype_r = header.dtype_bytes / 2  # analytic byte counts assume bf16
    comm_buffer_bytes = 2.0 * 3 * header.dtype_bytes * model.hidden  # Ulysses q,k,v send+receive
    a2a_bytes, a2a_ops = alltoall_bytes_per_token_layer(model)
    compute_coef = ComputeCoefficients(
        forward=fwd, backward=bwd, head_s_per_token=head_s * head_r,
        microbatch_overhead_s=fixed_s + head_fixed_s + model.num_layers * per_layer_s,
    )
    activation = ActivationCoefficients(
        bytes_per_token_layer_none=none_b * _ratio(none_full, none_prof),
        bytes_per_token_layer_full=full_b * _ratio(full_full, full_prof),
        working_bytes_per_token=head_bytes * head_bytes_r + comm_buffer_bytes,
        fixed_working_bytes=AnalyticConfig().fixed_working_bytes,
    )
    notes.append(f"per-layer micro-batch cost {per_layer_s:.3g} s x {model.num_layers} layers and "
                 f"fixed {fixed_s + head_fixed_s:.3g} s folded into microbatch_overhead_s; "
                 f"fixed_working_bytes is the analytic default")
    links, comm_res = fit_comm(comm, cfg)
    terms.update(comm_res)
    comm_coef = _comm_coefficients(links, cfg.comm_fallback_hardware or header.hardware, model, notes)
    comm_coef = comm_coef.model_copy(update={
        "alltoall_bytes_per_token_layer": a2a_bytes * dtype_r, "alltoall_ops_per_layer": a2a_ops,
        "grad_bytes_per_param": float(header.dtype_bytes)})
    poor = {n: t.mape for n, t in terms.items() if t.mape > cfg.max_mape}
    if poor:
        listing = ", ".join(f"{n} {m:.1%}" for n, m in poor.items())
        if not cfg.force:
            raise FitRefusedError(
                f"fit refused: held-out MAPE above {cfg.max_mape:.0%} on {listing} "
                "(profile with more repeats or larger sizes, or override with --force)"
            )
        notes.append(f"FORCED despite held-out MAPE above {cfg.max_mape:.0%}: {listing}")
        logger.warning("fit forced despite %s", listing)
    file = CostModelFile(
        id=cfg.model_id or f"fitted-{model.name}-{header.hardware}",
        provenance="fitted", model=model, hardware=header.hardware, num_params=num_params(model),
        compute=compute_coef, activation=activation, comm=comm_coef,
        fit_quality={n: t.to_term_fit() for n, t in terms.items()}, notes="; ".join(notes),
    )
    return FitResult(file=file, terms=terms)


def _comm_coefficients(links: dict[str, list[LinkFit]], hardware: str, model: ModelSpec,
                       notes: list[str]) -> CommCoefficients:
    """Measured links, completed from the analytic model (or the intra fits) where unmeasured."""
    analytic: CommCoefficients | None = None
    try:
        analytic = analytic_cost_model(model, load_hardware(hardware)).comm
    except ValueError:
        analytic = None
    out: dict[str, list[LinkFit]] = {}
    for op in ("alltoall", "allreduce"):
        fits = list(links[op])
        for placement in ("intra", "inter"):
            if any(f.placement == placement for f in fits):
                continue
            if analytic is not None:
                fits += [f for f in getattr(analytic, op) if f.placement == placement]
                notes.append(f"{op} {placement}: not measured, analytic default for {hardware}")
            elif placement == "inter" and fits:
                fits += [f.model_copy(update={"placement": "inter"}) for f in fits]
                notes.append(f"{op} inter: not measured and no hardware preset {hardware!r}; "
                             "intra-node fits reused")
                logger.warning("%s inter-node not measured: reusing intra-node fits", op)
            else:
                raise ValueError(
                    f"no {op} measurements and no hardware preset {hardware!r} to fall back on: "
                    "give a profile made by `dcp profile-comm` (or a fallback hardware preset)"
                )
        out[op] = fits
    return CommCoefficients(alltoall_bytes_per_token_layer=0.0, alltoall_ops_per_layer=0,
                            alltoall=out["alltoall"], allreduce=out["allreduce"])
