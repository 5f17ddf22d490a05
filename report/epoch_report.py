"""An epoch's pictures: the plans' predicted speedup over each baseline and their gap to the lower
bound, step by step, from the figures every stored plan records; once ranks have posted
measurements, the prediction error of each measured step."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from matplotlib import ticker
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


WEAK_FACTOR = 1.25
"""A baseline whose mean speedup is more than this times the strongest baseline's goes to the
secondary panel: the headline panel keeps the comparisons that are close (on a linear axis, so
1.02x and 1.07x look as different as they are)."""


def split_baselines(steps: Sequence[StepFigures]) -> tuple[list[str], list[str]]:
    """``(strong, weak)`` baseline names: strongest first, then the baselines within
    :data:`WEAK_FACTOR` of it (by mean speedup); the rest (and ``naive``) weak."""
    summaries = summarise(steps)
    by_name = {b.name: b.mean_speedup for b in summaries}
    head = by_name.get(STRONGEST)
    strong = [STRONGEST] if head is not None else []
    weak: list[str] = []
    for b in summaries:
        if b.name == STRONGEST:
            continue
        close = head is not None and b.mean_speedup <= head * WEAK_FACTOR and b.name not in NOT_HEADLINE
        (strong if close else weak).append(b.name)
    return strong, weak


class SpeedupFormatter(ticker.Formatter):
    """Tick labels ``1.0025x`` with as many decimals as the ticks need (at least 2, at most 4 to
    show them exactly, else as many as keep them distinct), so a narrow range (every speedup within
    1.00-1.02x) gets true, distinct labels, not ``1.01x`` four times."""

    @staticmethod
    def decimals(values: Sequence[float]) -> int:
        """Decimals that label ``values`` exactly (2 to 4), else distinctly (up to 8)."""
        locs = [float(v) for v in values]
        for decimals in range(2, 5):
            if all(abs(round(v, decimals) - v) <= 1e-9 * max(1.0, abs(v)) for v in locs):
                return decimals
        for decimals in range(2, 9):
            if len({f"{v:.{decimals}f}" for v in locs}) == len(set(locs)):
                return decimals
        return 8

    def format_ticks(self, values: Sequence[float]) -> list[str]:
        """The labels of the axis' ticks ``values``, all with the same decimals."""
        decimals = self.decimals(values)
        return [f"{float(v):.{decimals}f}x" for v in values]

    def __call__(self, x: float, pos: int | None = None) -> str:
        """The label of one value (a cursor readout): two decimals."""
        return f"{x:.2f}x"


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
"""Each baseline's own marker (in order of drawing), so lines that coincide stay apart."""
DASHES = ("-", "--", "-.", (0, (1, 1)), (0, (5, 1, 1, 1)))
"""Each baseline's own line pattern, for the same reason (and for epochs too long for markers)."""


def _speedup_panel(ax: Axes, ordered: Sequence[StepFigures], names: Sequence[str], *, window: int,
                   marker: str | None, title: str, colors: Iterator[str]) -> None:
    """One line per baseline. Lines often coincide: the strongest baseline is, at every step, one of
    the others, and two baselines can make the same plan. So the strongest is a wide grey band
    under the rest, and every other baseline has its own colour, marker and dash pattern (a line
    drawn exactly over another still shows its markers and the gaps of its dashes)."""
    x = [s.step for s in ordered]
    drawn = 0
    for name in names:
        ys = rolling_mean([s.speedups().get(name, math.nan) for s in ordered], window)
        if name == STRONGEST:
            ax.plot(x, ys, color="#555555", alpha=0.35, linewidth=7.0, solid_capstyle="round", zorder=1,
                    label="strongest baseline (fastest but naive, per step)", gid="speedup-strongest")
        else:
            style = ":" if name in NOT_HEADLINE else DASHES[drawn % len(DASHES)]
            ax.plot(x, ys, color=next(colors, "#888888"), linewidth=1.3, linestyle=style,
                    marker=MARKERS[drawn % len(MARKERS)] if marker else None, markersize=4.5,
                    markerfacecolor="none", markeredgewidth=1.1, zorder=2 + drawn, label=name,
                    gid=f"speedup-{name}")
            drawn += 1
    ax.axhline(1.0, color="#888888", linewidth=0.8, linestyle="--")
    ax.yaxis.set_major_formatter(SpeedupFormatter())
    ax.set_ylabel("speedup: baseline time\n/ plan time")
    ax.set_title(title + (f" (mean over a sliding window of {window} steps)" if window > 1 else ""), loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.5)


def epoch_figure(steps: Sequence[StepFigures], *, title: str, errors: Sequence[StepError] = ()) -> Figure:
    """The predicted speedup over the strongest baseline and the baselines close to it (top,
    linear axis), the gap to the lower bound, with measurements the prediction error of each
    measured step, and the weak baselines' speedups (bottom panel, where there are any).

    Raises:
        ValueError: without a step.
    """
    if not steps:
        raise ValueError("an epoch report needs at least one planned step")
    ordered = sorted(steps, key=lambda s: s.step)
    x = [s.step for s in ordered]
    marker = "o" if len(ordered) <= 64 else None
    strong, weak = split_baselines(ordered)
    rows = [3.0, 2.0] + ([2.0] if errors else []) + ([2.0] if weak else [])
    fig = Figure(figsize=(12.0, 2.5 + 2.0 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), 1, sharex=True, gridspec_kw={"height_ratios": rows})
    top, bottom = axes[0], axes[1]
    colors = iter(["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#E377C2",
                   "#9D755D", "#EECA3B", "#BAB0AC"])
    window = rolling_window(len(ordered))
    _speedup_panel(top, ordered, strong, window=window, marker=marker, colors=colors,
                   title="Predicted speedup of the plans over the strongest baseline and those within "
                         f"{WEAK_FACTOR:g}x of it")
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
    if weak:
        _speedup_panel(axes[-1], ordered, weak, window=window, marker=marker, colors=colors,
                       title="Weak baselines (more than "
                             f"{WEAK_FACTOR:g}x the strongest's speedup; the DCP paper compares with bucket-sp4)")
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
