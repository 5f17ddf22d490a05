"""An epoch's pictures: the plans' predicted speedup over each baseline and their gap to the lower
bound, step by step, from the figures every stored plan records; once ranks have posted
measurements, the prediction error of each measured step."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from planner.baselines import NOT_HEADLINE
from report.figures import STRONGEST, StepError, StepFigures, summarise
from report.render import ImageFormat, render

MAX_BARS = 400
"""Up to this many steps the gap is drawn as one bar per step, beyond as a filled area."""

MAX_RAW_STEPS = 100
"""Up to this many steps the speedup lines show every step; beyond, a centred sliding mean."""


def rolling_window(num_steps: int) -> int:
    """Steps averaged per point of the speedup lines (1 up to ``MAX_RAW_STEPS`` steps)."""
    return 1 if num_steps <= MAX_RAW_STEPS else math.ceil(num_steps / 50) | 1


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred sliding mean over ``window`` (odd) values, ignoring NaN (a baseline missing at a step)."""
    if window <= 1:
        return list(values)
    arr = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(arr)
    kernel = np.ones(window)
    sums = np.convolve(np.where(ok, arr, 0.0), kernel, mode="same")
    counts = np.convolve(ok.astype(np.float64), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return [float(v) for v in np.where(counts > 0, sums / counts, np.nan)]


def epoch_figure(steps: Sequence[StepFigures], *, title: str, errors: Sequence[StepError] = ()) -> Figure:
    """Speedup over each baseline (top) and gap to the lower bound (middle) per step, and with
    measurements the prediction error of each measured step (bottom).

    Raises:
        ValueError: without a step.
    """
    if not steps:
        raise ValueError("an epoch report needs at least one planned step")
    ordered = sorted(steps, key=lambda s: s.step)
    x = [s.step for s in ordered]
    marker = "o" if len(ordered) <= 64 else None
    fig = Figure(figsize=(12.0, 9.5 if errors else 7.0), layout="constrained")
    axes = fig.subplots(3 if errors else 2, 1, sharex=True,
                        gridspec_kw={"height_ratios": [3, 2, 2] if errors else [3, 2]})
    top, bottom = axes[0], axes[1]
    names = [b.name for b in summarise(ordered)]
    colors = iter(["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#E377C2",
                   "#9D755D", "#EECA3B", "#BAB0AC"])
    window = rolling_window(len(ordered))
    for name in names:
        ys = rolling_mean([s.speedups().get(name, math.nan) for s in ordered], window)
        if name == STRONGEST:
            top.plot(x, ys, color="black", alpha=0.35, linewidth=5.0, marker=marker, markersize=6, zorder=1,
                     label="strongest baseline (fastest but naive, per step)", gid="speedup-strongest")
        else:
            style = ":" if name in NOT_HEADLINE else "-"
            top.plot(x, ys, color=next(colors, "#888888"), linewidth=1.2, linestyle=style, marker=marker,
                     markersize=3, label=name, gid=f"speedup-{name}")
    top.axhline(1.0, color="#888888", linewidth=0.8, linestyle="--")
    top.set_yscale("log")
    top.yaxis.set_major_formatter(lambda v, _: f"{v:g}x")
    top.yaxis.set_minor_formatter(lambda v, _: f"{v:g}x" if v in (0.5, 1.5, 2, 3, 4, 6) else "")
    top.set_ylabel("speedup: baseline time / plan time\n(log scale)")
    top.set_title("Predicted speedup of the plans over each baseline"
                  + (f" (mean over a sliding window of {window} steps)" if window > 1 else ""), loc="left")
    top.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    top.grid(axis="y", color="#DDDDDD", linewidth=0.5, which="both")
    gaps = [100.0 * s.gap for s in ordered]
    if len(x) <= MAX_BARS:
        bars = bottom.bar(x, gaps, width=0.8 if len(x) > 1 else 0.4, color="#4C78A8")
        for s, bar in zip(ordered, bars, strict=True):
            bar.set_gid(f"gap-step{s.step}")
    else:  # one artist instead of thousands of bars
        bottom.fill_between(x, gaps, step="mid", color="#4C78A8", linewidth=0, gid="gap-area")
    bottom.set_ylabel("gap to the lower bound (%)")
    axes[-1].set_xlabel("step")
    mean_gap = sum(gaps) / len(gaps)
    bottom.axhline(mean_gap, color="black", linewidth=0.8, linestyle="--")
    bottom.set_title(f"Gap of each plan to its lower bound (dashed: mean {mean_gap:.2f}%)", loc="left")
    bottom.grid(axis="y", color="#DDDDDD", linewidth=0.5)
    if errors:
        _draw_errors(axes[2], errors)
    if len(x) <= 20:
        bottom.set_xticks(x)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11, fontweight="bold")
    return fig


def _draw_errors(ax: Axes, errors: Sequence[StepError]) -> None:
    """Per measured step: the micro-batches' MAPE (bars) and mean predicted / measured - 1 (line)."""
    ordered = sorted(errors, key=lambda e: e.step)
    xs = [e.step for e in ordered]
    mape = [100.0 * e.mape for e in ordered]
    bias = [100.0 * (e.mean_ratio - 1.0) for e in ordered]
    if len(xs) <= MAX_BARS:
        bars = ax.bar(xs, mape, width=0.8 if len(xs) > 1 else 0.4, color="#F58518", label="MAPE")
        for e, bar in zip(ordered, bars, strict=True):
            bar.set_gid(f"error-step{e.step}")
    else:
        ax.fill_between(xs, mape, step="mid", color="#F58518", linewidth=0, label="MAPE", gid="error-area")
    ax.plot(xs, bias, color="black", linewidth=1.2, marker="o" if len(xs) <= 64 else None, markersize=3,
            label="mean predicted / measured - 1", gid="error-bias")
    ax.axhline(0.0, color="#888888", linewidth=0.8)
    total = sum(e.num_micro_batches for e in ordered)
    mean = sum(e.mape * e.num_micro_batches for e in ordered) / total
    ax.set_title(f"Prediction error of the measured steps ({len(ordered)} steps, {total} micro-batches, "
                 f"MAPE {mean:.1%})", loc="left")
    ax.set_ylabel("micro-batch time error (%)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.5)


def epoch_image(steps: Sequence[StepFigures], *, title: str, fmt: ImageFormat,
                errors: Sequence[StepError] = ()) -> bytes:
    """The epoch chart as PNG or SVG bytes.

    Raises:
        ValueError: without a step, or for an unknown format.
    """
    if not steps:
        raise ValueError("an epoch report needs at least one planned step")
    return render(lambda: epoch_figure(steps, title=title, errors=errors), fmt)
