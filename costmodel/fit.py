"""Fit a cost-model file to profiles (numpy/scipy only: the service can fit without torch).

The per-term fitters and the functional forms they fit are in ``costmodel.fit_terms``; this
module is the driver: it checks the profiles agree, runs each fitter, scales a narrower or
shallower profiled shape to the full model (per-layer terms apply to every layer of the full
model; width changes are scaled by the analytic FLOP and byte ratios of ``costmodel.analytic``,
noted in the file), completes unmeasured collectives from the hardware preset, and refuses a
fit whose held-out MAPE on any term exceeds ``max_mape`` (``FitRefusedError``) unless ``force``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from costmodel.analytic import (
    AnalyticConfig,
    activation_bytes_per_token_layer,
    alltoall_bytes_per_token_layer,
    analytic_cost_model,
    attention_flops_per_pair,
    linear_flops_per_token_layer,
    num_params,
)
from costmodel.fit_comm import fit_comm, p2p_term
from costmodel.fit_diagnosis import RecordFactors, diagnose
from costmodel.fit_memory import fit_activation, fit_head_transient, fit_peak
from costmodel.fit_terms import (
    SplitConfig,
    TermResult,
    fit_compute,
    fit_head,
    mape,
    relative_nnls,
    split_indices,
)
from costmodel.model_terms import kv_head_bytes_per_token_layer
from costmodel.model_terms import terms as kind_terms
from costmodel.presets import load_hardware
from costmodel.profiling.format import CommRecord, Profile, ProfileHeader, RingAttentionRecord
from costmodel.ring.fit import RingFit, fit_ring
from costmodel.schema import (
    ActivationCoefficients,
    CommCoefficients,
    ComputeCoefficients,
    CostModelFile,
    LayerTimeTerms,
    LinkFit,
)
from costmodel.specs import ModelSpec

logger = logging.getLogger(__name__)

REFIT_ADVICE = {
    "compute_time": "profile again with more repeats (dcp profile --repeats), on a busy CPU with "
                    "one thread and its CPU time (--threads 1 --cpu-clock thread)",
    "activation_bytes": "check the profile's activation bytes (they are exact and should fit)",
    "peak_bytes": "the peaks are not kept layers plus the larger of a plain layer's transient and a "
                  "recomputed layer (plus bytes per layer): check the profile's device_peak_bytes; a "
                  "model-form error will not go away with more repeats",
    "head_time": "measure the head at more sizes (dcp profile --head-sizes 10 --repeats 9)",
    "alltoall": "measure the collectives with more repeats (dcp profile-comm --repeats 30)",
    "allreduce": "measure the collectives with more repeats (dcp profile-comm --repeats 30)",
    "p2p": "measure the p2p hops with more repeats (dcp profile-comm --ops p2p --repeats 30)",
}
"""What to do when a term's held-out error is too high (the refusal message says it)."""
TERM_NAMES = ("compute_time", "activation_bytes", "peak_bytes", "head_time", "alltoall", "allreduce")
__all__ = ["FitConfig", "FitRefusedError", "FitResult", "TermResult", "fit_profiles", "mape",
           "relative_nnls", "split_indices"]


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
    hardware: str | None = None
    """Hardware the fitted file describes (default: the profile's ``hardware``); plans may use
    it only on clusters of this hardware."""
    attention_half_tokens: float | None = None
    """Fix the attention half-performance length instead of fitting it (profiles without
    group sizes above 1 cannot identify it)."""

    def __post_init__(self) -> None:
        if not 0 < self.holdout_fraction < 1:
            raise ValueError(f"holdout_fraction must be in (0, 1), got {self.holdout_fraction}")
        if self.max_mape <= 0:
            raise ValueError(f"max_mape must be positive, got {self.max_mape}")
        if self.attention_half_tokens is not None and not self.attention_half_tokens >= 0:
            raise ValueError(f"attention_half_tokens must be >= 0, got {self.attention_half_tokens}")

    @property
    def split(self) -> SplitConfig:
        """The hold-out split and timing statistic every term uses."""
        return SplitConfig(holdout_fraction=self.holdout_fraction, seed=self.seed,
                           time_statistic=self.time_statistic)


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted file and the per-term results behind it."""

    file: CostModelFile
    terms: dict[str, TermResult]
    compute_fixed_s: float = 0.0
    """Fixed cost of a compute record outside its layers (part of ``microbatch_overhead_s``)."""
    head_fixed_s: float = 0.0
    """Fixed cost of a head record (the rest of ``microbatch_overhead_s``)."""


# ------------------------------------------------------------------------------------ assemble
def _ratio(full: float, profiled: float) -> float:
    return full / profiled if profiled > 0 else 1.0


def _scale_terms(t: LayerTimeTerms, *, token: float, pair: float, moved: float) -> LayerTimeTerms:
    return LayerTimeTerms(per_token=t.per_token * token, per_attn_pair=t.per_attn_pair * pair,
                          per_spatial_pair=t.per_spatial_pair * pair,
                          per_temporal_pair=t.per_temporal_pair * pair, per_sample=t.per_sample,
                          per_call=t.per_call, per_token_relayout=t.per_token_relayout * moved)


def _fit_ring(comm: Sequence[CommRecord], attention: Sequence[RingAttentionRecord], split: SplitConfig, *,
              hardware: str, notes: list[str]) -> RingFit | None:
    """The ring's coefficients (:func:`costmodel.ring.fit.fit_ring`), merges at the HBM bandwidth of
    the profile's hardware preset (the analytic H200's where it has none, said in the notes)."""
    try:
        hbm = load_hardware(hardware).hbm_bandwidth_bytes_per_s
    except ValueError:
        hbm = load_hardware("h200-sxm").hbm_bandwidth_bytes_per_s
        notes.append(f"ring merges: no hardware preset {hardware!r}, fitted against the h200-sxm HBM bandwidth")
    ring = fit_ring([r for r in comm if r.op == "ring_step"], attention, split, hbm_bytes_per_s=hbm)
    if ring is not None:
        c = ring.coefficients
        notes.append(f"ring: exposed fraction {c.exposed_fraction:.3g}, {c.step_overhead_s * 1e6:.3g} us per step, "
                     f"block half-performance length {c.block_half_tokens:.4g} tokens, merges "
                     f"{c.merge_bytes_per_channel:.3g} B per channel ({c.source})")
    return ring


def _merge_headers(profiles: Sequence[Profile]) -> tuple[ProfileHeader, ModelSpec, ModelSpec]:
    compute_headers = [p.header for p in profiles if p.header.model is not None]
    if not compute_headers:
        raise ValueError("no compute profile: give a profile made by `dcp profile`")
    first = compute_headers[0]
    hardware = {p.header.hardware for p in profiles}
    if len(hardware) > 1:
        raise ValueError(f"profiles are for different hardware: {sorted(hardware)}")
    for h in compute_headers[1:]:
        assert h.model is not None and h.profiled is not None and first.model is not None and first.profiled is not None
        differ = [*first.model.shape_differences(h.model), *first.profiled.shape_differences(h.profiled)]
        if differ or h.dtype != first.dtype:
            # models are matched by shape: one model profiled under two names is one model
            raise ValueError("compute profiles disagree on model, profiled shape or dtype: "
                             + "; ".join(differ or [f"dtype {first.dtype} != {h.dtype}"]))
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
    split = cfg.split
    cfit = fit_compute(compute, model.kind, split, attention_half_tokens=cfg.attention_half_tokens)
    fwd, bwd, fixed_s = cfit.forward, cfit.backward, cfit.fixed_s
    none_b, full_b, act_res = fit_activation(compute, split)
    terms = {"compute_time": cfit.result, "activation_bytes": act_res}
    peak = fit_peak(compute, none_bytes=none_b, full_bytes=full_b, split=split)
    transient_b, per_layer_b, recomputed_b = 0.0, 0.0, None
    if peak is not None:
        terms["peak_bytes"] = peak.result
        transient_b, per_layer_b, recomputed_b = peak.transient_bytes, peak.per_layer_bytes, peak.recomputed_bytes
        if peak.ckpt_free:  # the peaks hold more per checkpointed layer than its saved input
            full_b = peak.ckpt_bytes
    head_s, head_fixed_s, head_bytes, head_transient_b = 0.0, 0.0, 0.0, None
    if heads:
        head_s, head_fixed_s, head_bytes, terms["head_time"] = fit_head(heads, split)
        head_transient_b = fit_head_transient(heads)
    sizes = sorted({r.group_size for r in compute})
    notes = [f"fitted to {len(compute)} compute (group sizes {sizes}), {len(heads)} head and "
             f"{len(comm)} comm records ({header.device} {header.device_name!r}, {header.dtype}, "
             f"timer {header.timer or 'unstated'}, statistic {cfg.time_statistic})",
             f"profiled shape: {profiled.num_layers} layers, hidden {profiled.hidden}, "
             f"heads {profiled.num_heads}, ffn {profiled.ffn_hidden}, vocab {profiled.vocab}, "
             f"text tokens {profiled.cross_attention_tokens}",
             f"attention half-performance length {cfit.attention_half_tokens:.4g} tokens per rank "
             + ("(fixed by the caller)" if cfg.attention_half_tokens is not None else "(fitted)"),
             "dense parts' half-performance length and launches fitted together as per_call"]
    if peak is None:
        notes.append("no device_peak_bytes in the profile: transient working set not fitted (0)")
    # Width scaling by analytic FLOP and byte ratios (identity when the width is the model's).
    token_r = _ratio(linear_flops_per_token_layer(model), linear_flops_per_token_layer(profiled))
    pair_r = _ratio(attention_flops_per_pair(model), attention_flops_per_pair(profiled))
    # the re-layout moves the all-to-all's bytes
    moved_r = _ratio(alltoall_bytes_per_token_layer(model)[0], alltoall_bytes_per_token_layer(profiled)[0])
    none_full, full_full = activation_bytes_per_token_layer(model)
    none_prof, full_prof = activation_bytes_per_token_layer(profiled)
    # the output head (1d: h x V) or patch (un)embedding (video) by its FLOPs and held values
    row, row_profiled = kind_terms(model), kind_terms(profiled)
    head_r = _ratio(row.head_flops_per_token(model), row_profiled.head_flops_per_token(profiled))
    head_bytes_r = _ratio(row.head_values_per_token(model), row_profiled.head_values_per_token(profiled))
    scaled = any(abs(r - 1) > 1e-12 for r in (token_r, pair_r, head_r))
    if scaled:
        notes.append(f"scaled to the full width by analytic ratios: per token x{token_r:.4g}, "
                     f"per pair x{pair_r:.4g}, head x{head_r:.4g}; fit_quality is for the "
                     "profiled shape")
    fwd = _scale_terms(fwd, token=token_r, pair=pair_r, moved=moved_r)
    bwd = _scale_terms(bwd, token=token_r, pair=pair_r, moved=moved_r)
    # Ulysses q,k,v send+receive buffers: measured in the records of group sizes above 1 (the
    # emulated all-to-all allocates them), an analytic allowance only for profiles without any.
    emulated = any(r.group_size > 1 for r in compute)
    comm_buffer_bytes = (peak.buffer_bytes * _ratio(model.hidden, profiled.hidden) if emulated and peak is not None
                         else 0.0 if emulated else 2.0 * 3 * header.dtype_bytes * model.hidden)
    if not emulated:
        notes.append("no compute record at a group size above 1: all-to-all buffers added "
                     "analytically to working_bytes_per_token")
    a2a_bytes, a2a_ops = alltoall_bytes_per_token_layer(model, dtype_bytes=header.dtype_bytes)
    compute_coef = ComputeCoefficients(
        forward=fwd, backward=bwd, head_s_per_token=head_s * head_r,
        microbatch_overhead_s=fixed_s + head_fixed_s,
        attention_half_tokens=cfit.attention_half_tokens,
    )
    activation = ActivationCoefficients(
        bytes_per_token_layer_none=none_b * _ratio(none_full, none_prof),
        bytes_per_token_layer_full=full_b * _ratio(full_full, full_prof),
        working_bytes_per_token=head_bytes * head_bytes_r + comm_buffer_bytes,
        fixed_working_bytes=AnalyticConfig().fixed_working_bytes,
        transient_bytes_per_token=transient_b * _ratio(none_full, none_prof),
        recomputed_layer_bytes_per_token=(None if recomputed_b is None
                                          else recomputed_b * _ratio(none_full, none_prof)),
        head_transient_bytes_per_token=(head_transient_b or 0.0) * head_bytes_r,
        # a layer's weight-gradient buffers grow with its parameters, as its FLOPs per token do
        fixed_working_bytes_per_layer=per_layer_b * token_r,
        # replicated key/value heads (groups past the KV heads): the analytic count at the dtype
        kv_head_bytes_per_token_layer=kv_head_bytes_per_token_layer(model, dtype_bytes=header.dtype_bytes),
    )
    notes.append(f"fixed micro-batch cost {fixed_s + head_fixed_s:.3g} s (layers' stack and head) in "
                 "microbatch_overhead_s; fixed_working_bytes is the analytic default")
    if peak is not None:
        notes.append(peak.structure(none_b) + " of the profiled shape")
    if heads and head_transient_b is None:
        notes.append("no device_peak_bytes in the head records: the head's transient working set "
                     "is not fitted (0)")
    links, comm_res = fit_comm(comm, split)
    in_layer = sorted({r.group_size for r in comm if r.op == "alltoall" and r.context == "in_layer"})
    if in_layer:
        notes.append(f"all-to-all of group size(s) {', '.join(map(str, in_layer))}: latency fitted to in-layer "
                     "records (what a call adds inside the layers), bandwidth to the isolated ones where "
                     "there are any")
    terms.update(comm_res)
    comm_coef = _comm_coefficients(links, cfg.comm_fallback_hardware or header.hardware, model, notes)
    p2p = p2p_term([r for r in comm if r.op == "p2p"], fallback_hardware=cfg.comm_fallback_hardware
                   or header.hardware, notes=notes)
    if p2p is not None:
        terms["p2p"] = p2p[1]
    ring = _fit_ring(comm, [r for p in profiles for r in p.ring_attention], split,
                     hardware=cfg.comm_fallback_hardware or header.hardware, notes=notes)
    if ring is not None:
        terms.update(ring.terms)
    comm_coef = comm_coef.model_copy(update={
        "p2p": p2p[0] if p2p is not None else None,
        "ring": ring.coefficients if ring is not None else None,
        "alltoall_bytes_per_token_layer": a2a_bytes, "alltoall_ops_per_layer": a2a_ops,
        "alltoall_kv_head_bytes_per_token_layer": kv_head_bytes_per_token_layer(model, dtype_bytes=header.dtype_bytes),
        "grad_bytes_per_param": float(header.dtype_bytes)})
    poor = {n: t.mape for n, t in terms.items() if t.mape > cfg.max_mape}
    if poor:
        listing = ", ".join(f"{n} {m:.1%}" for n, m in poor.items())
        factors = RecordFactors.of_compute(compute)
        verdicts = {n: diagnose(terms[n], factors).describe() for n in poor if n in COMPUTE_TERMS}
        found = "; ".join(f"{n}: {v}" for n, v in verdicts.items())
        if not cfg.force:
            advice = list(dict.fromkeys(REFIT_ADVICE.get(n, REFIT_ADVICE["compute_time"]) for n in poor))
            if cfg.time_statistic != "min" and any(n not in MEMORY_TERMS for n in poor):
                advice.append("on a shared machine fit the fastest repeat (--time-statistic min)")
            raise FitRefusedError(
                f"fit refused: held-out MAPE above {cfg.max_mape:.0%} on {listing}"
                + (f" ({found})" if found else "") + f". To fix: {'; '.join(advice)}; or keep the fit "
                "anyway, noted in the file and with its held-out memory error as the planner's margin "
                "(dcp fit --force; API options.force)"
            )
        notes.append(f"FORCED despite held-out MAPE above {cfg.max_mape:.0%}: {listing}"
                     + (f" ({found})" if found else ""))
        logger.warning("fit forced despite %s", listing)
        activation = _with_memory_margin(activation, terms, poor, notes)
    elif peak is not None:
        notes.append(f"peak_bytes residuals: {diagnose(peak.result, RecordFactors.of_compute(compute)).describe()}")
    hardware = cfg.hardware or header.hardware
    file = CostModelFile(
        id=cfg.model_id or f"fitted-{model.name}-{hardware}",
        provenance="fitted", model=model, hardware=hardware, num_params=num_params(model),
        compute=compute_coef, activation=activation, comm=comm_coef,
        fit_quality={n: t.to_term_fit() for n, t in terms.items()}, notes="; ".join(notes),
    )
    return FitResult(file=file, terms=terms, compute_fixed_s=fixed_s, head_fixed_s=head_fixed_s)


MEMORY_TERMS = ("activation_bytes", "peak_bytes")
"""Terms that guard memory: a forced fit of one of them is used with its held-out error as a margin."""
COMPUTE_TERMS = ("compute_time", "activation_bytes", "peak_bytes")
"""Terms fitted to the compute records (their residuals are grouped by size and policy)."""


def _with_memory_margin(activation: ActivationCoefficients, terms: dict[str, TermResult], poor: dict[str, float],
                        notes: list[str]) -> ActivationCoefficients:
    """The forced fit's margin: the worst held-out under-prediction of a forced memory term
    (peaks up to that much above the prediction), computed once and recorded in the file
    (``memory_margin_fraction``). The coefficients stay as fitted; the planner keeps the larger
    of its own ``memory_safety_fraction`` and the margin's share of the activation budget free,
    so the two never stack (``MemoryCosts.reserved_budget_fraction``)."""
    margin = max((terms[n].worst_underprediction for n in poor if n in MEMORY_TERMS), default=0.0)
    if margin <= 0:
        return activation
    notes.append(f"memory margin {margin:.1%}: the forced fit under-predicted a held-out peak by that much; "
                 f"plans keep max(memory_safety_fraction, {margin / (1 + margin):.3f}) of the activation "
                 "budget free")
    logger.warning("forced memory fit: margin %.3f of the activation bytes", margin)
    return activation.model_copy(update={"memory_margin_fraction": margin})


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
