"""Published kernel efficiency by size: what the analytic default prices short kernels with.

The data is ``costmodel/presets/kernel_efficiency.json`` (each point with its source, cited in
docs/cost-model.md): per accelerator, flash-attention throughput by sequence length, head dim,
pass and mask, and dense GEMM throughput by rows. This module turns it into
:class:`costmodel.schema.EfficiencyCurve` s (achieved share of peak by size, log-linear in the size)
and fits the GEMM points with the Hockney form the cost model's dense parts use:

* attention: a sample's attention kernel runs over its whole sequence under Ulysses (each rank
  holds all ``s`` tokens of its ``H/d`` heads after the all-to-all) and over a block of ``s/r``
  tokens in each step of a ring of ``r``; its time is ``pairs * per_pair / efficiency(length)``;
* GEMMs run over the call's rows per rank ``n`` (tokens of the micro-batch over ``d``); the points
  are fitted by ``efficiency(n) = e_inf * n / (n + n_half)`` (Hockney & Jesshope 1988; ``e_inf``
  the best measured point, ``n_half`` by least squares, :func:`fit_gemm`), which keeps a micro-batch's time
  a fixed part plus a part additive over its samples (``costmodel.evaluate``).

A hardware without a table (e.g. ``a100-80g``) gets ``None``: the analytic model then keeps its
spec-derived constants.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

import numpy as np

from costmodel.schema import AttentionEfficiency, EfficiencyCurve

Pass = Literal["forward", "backward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmFit:
    """The Hockney form through a hardware's published GEMM points."""

    peak_efficiency: float
    """``e_inf``: share of peak the GEMMs approach on many rows."""
    half_rows: float
    """``n_half``: rows per rank at which they reach half of it."""
    curve: EfficiencyCurve
    """The published points themselves (for display and tests)."""

    def at(self, rows: object) -> np.ndarray:
        """Efficiency of the fitted form at ``rows``."""
        n = np.asarray(rows, dtype=np.float64)
        return np.asarray(self.peak_efficiency * n / (n + self.half_rows), dtype=np.float64)


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelEfficiency:
    """The efficiency a hardware's kernels reach, from published points."""

    hardware: str
    peak_flops: float
    """The peak the efficiencies are shares of (FLOP/s)."""
    attention: AttentionEfficiency
    gemm: GemmFit
    notes: str
    """Which curves were used and how they were derived (head dim fallback, borrowed curves)."""


@cache
def _table() -> dict[str, Any]:
    node = resources.files("costmodel").joinpath("presets", "kernel_efficiency.json")
    data: dict[str, Any] = json.loads(node.read_text())
    return data


def hardware_with_curves() -> list[str]:
    """Hardware names the table covers."""
    return sorted(_table()["hardware"])


def _curve(points: list[list[Any]], *, peak_tflops: float, scale: float = 1.0) -> EfficiencyCurve:
    sources = _table()["sources"]
    keys = sorted({str(p[2]) for p in points})
    return EfficiencyCurve(tokens=[float(p[0]) for p in points],
                           efficiency=[min(1.0, float(p[1]) * scale / peak_tflops) for p in points],
                           source="; ".join(sources[k] for k in keys))


def _attention_entries(name: str) -> tuple[list[dict[str, Any]], float, float, str]:
    """The attention entries ``name`` uses: ``(entries, peak TFLOP/s they were measured against,
    scale of their efficiencies, derivation note)``."""
    hw = _table()["hardware"][name]
    if "same_as" in hw:
        entries, peak, scale, _ = _attention_entries(hw["same_as"])
        return entries, peak, scale, f"attention and GEMM points of {hw['same_as']} ({hw['derivation']})"
    if "attention_derived_from" in hw:
        base = _table()["hardware"][hw["attention_derived_from"]]
        best = max(p[1] for e in base["attention"] for p in e["points"]) / base["peak_tflops"]
        return (base["attention"], float(base["peak_tflops"]), hw["attention_scale_to_max_efficiency"] / best,
                hw["derivation"])
    return hw["attention"], float(hw["peak_tflops"]), 1.0, ""


def _pick(entries: list[dict[str, Any]], *, head_dim: int, pass_: Pass, causal: bool) -> tuple[dict[str, Any], str]:
    """The entry of the nearest head dim (in log2) for this pass, the mask when there is a choice."""
    same_pass = [e for e in entries if e["pass"] == pass_]
    nearest = min(abs(math.log2(e["head_dim"]) - math.log2(head_dim)) for e in same_pass)
    near = [e for e in same_pass if abs(math.log2(e["head_dim"]) - math.log2(head_dim)) == nearest]
    masked = [e for e in near if e["causal"] == causal] or near
    chosen = min(masked, key=lambda e: e["head_dim"])
    notes = []
    if chosen["head_dim"] != head_dim:
        notes.append(f"{pass_} head dim {chosen['head_dim']} used for {head_dim}")
    if chosen["causal"] != causal:
        notes.append(f"{pass_} {'causal' if chosen['causal'] else 'unmasked'} curve used for a "
                     f"{'causal' if causal else 'unmasked'} model (the only one published)")
    return chosen, "; ".join(notes)


def fit_gemm(curve: EfficiencyCurve) -> tuple[float, float]:
    """``(e_inf, n_half)`` of the Hockney form through a GEMM curve's points: ``e_inf`` the best
    measured efficiency (the form never promises more than was measured), ``n_half`` by least
    squares on ``1/efficiency - 1/e_inf = (n_half / e_inf) / rows``.

    Raises:
        ValueError: with fewer than two points.
    """
    if len(curve.tokens) < 2:
        raise ValueError(f"a GEMM curve needs two points or more, got {len(curve.tokens)}")
    e_inf = curve.max_efficiency
    x = 1.0 / np.asarray(curve.tokens)
    y = 1.0 / np.asarray(curve.efficiency) - 1.0 / e_inf
    slope = float(np.dot(x, y) / np.dot(x, x))
    return e_inf, max(0.0, slope * e_inf)


def kernel_efficiency(hardware: str, *, head_dim: int, causal: bool) -> KernelEfficiency | None:
    """The published efficiency of ``hardware``'s kernels for a model of ``head_dim`` and mask,
    or None for a hardware the table does not cover."""
    table = _table()["hardware"]
    if hardware not in table:
        return None
    hw = table[hardware]
    entries, base_peak, scale, derivation = _attention_entries(hardware)
    fwd, fwd_note = _pick(entries, head_dim=head_dim, pass_="forward", causal=causal)
    bwd, bwd_note = _pick(entries, head_dim=head_dim, pass_="backward", causal=causal)
    attention = AttentionEfficiency(forward=_curve(fwd["points"], peak_tflops=base_peak, scale=scale),
                                    backward=_curve(bwd["points"], peak_tflops=base_peak, scale=scale))
    gemm_hw = table[hw["same_as"]] if "same_as" in hw else hw
    gemm_curve = _curve(gemm_hw["gemm"]["points"], peak_tflops=float(gemm_hw["peak_tflops"]))
    e_inf, n_half = fit_gemm(gemm_curve)
    notes = "; ".join(n for n in (derivation, fwd_note, bwd_note) if n)
    return KernelEfficiency(hardware=hardware, peak_flops=float(hw["peak_tflops"]) * 1e12, attention=attention,
                            gemm=GemmFit(peak_efficiency=e_inf, half_rows=n_half, curve=gemm_curve), notes=notes)
