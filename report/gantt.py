"""The Gantt chart of one step: every SP group's micro-batches over time, by kind of work.

One panel per plan (DCP's plan above, the strongest baseline's below, same time axis). The
vertical axis is the rank, so a group of ``d`` GPUs is a band ``d`` ranks tall and an area is
GPU-seconds. Each micro-batch is a bar split in proportion into compute, recompute and
all-to-all (``planner.timeline``: the split is of its time, not an order in time); a group that
ends early idles until the slowest group ends; then the whole world syncs gradients.

In the SVG, each panel's micro-batches are the paths of the group ``<g id="{key}-microbatches">``
(one per micro-batch; ``key`` is ``dcp`` or ``baseline``), each kind of work the group
``<g id="{key}-{kind}">``. :func:`with_hover_titles` gives each micro-batch path a ``<title>``
(its group, samples, tokens and times), which a browser shows on hover.

At hundreds of GPUs a 1-rank group is under a pixel tall: bands thinner than ``THIN_BAND_PX``
lose their padding and white edges (so the colours show) and are drawn in a checkerboard of two
shades, neighbouring groups and consecutive micro-batches alternating (without it a 1,024-GPU
plan was one block of compute blue), and runs of equal-size groups share one label
(``ranks 496-1023 (528 groups of SP 1)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from planner.timeline import StepTimeline
from report.render import PNG_DPI

COLORS: dict[str, str] = {
    "compute": "#4C78A8",
    "recompute": "#F58518",
    "alltoall": "#B279A2",
    "ring": "#E45756",
    "grad_sync": "#54A24B",
    "idle": "#E6E6E6",
}
"""Fill of each kind of work."""

LABELS: dict[str, str] = {
    "compute": "compute (forward + backward)",
    "recompute": "recompute (checkpointing)",
    "alltoall": "all-to-all (Ulysses SP)",
    "ring": "ring hops not hidden, merges",
    "grad_sync": "gradient sync (all ranks)",
    "idle": "idle (waiting for the slowest group)",
}
"""Legend line of each kind."""

_PAD = 0.08
"""Gap between group bands, in ranks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GanttPanel:
    """One plan to draw."""

    key: str
    """Element id prefix in the SVG (``dcp``, ``baseline``)."""
    title: str
    """Panel title."""
    timeline: StepTimeline
    """The plan's step (``planner.timeline.step_timeline``)."""
    lower_bound_s: float | None = None
    """Drawn as a dashed line when given."""


def _box(x0: float, x1: float, y0: float, y1: float) -> list[tuple[float, float]]:
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


def group_label(first_rank: int, size: int) -> str:
    """``ranks 0-3 (SP 4)`` or ``rank 5 (SP 1)``."""
    ranks = f"rank {first_rank}" if size == 1 else f"ranks {first_rank}-{first_rank + size - 1}"
    return f"{ranks} (SP {size})"


MAX_GROUP_LABELS = 24
"""Up to this many groups each gets its label; beyond, runs of equal-size groups share one."""


def group_ticks(groups: Sequence[tuple[int, int]]) -> tuple[list[float], list[str]]:
    """Label positions (rank) and texts for ``(first_rank, size)`` groups in rank order."""
    if len(groups) <= MAX_GROUP_LABELS:
        return ([first + size / 2 for first, size in groups],
                [group_label(first, size) for first, size in groups])
    runs: list[list[tuple[int, int]]] = []
    for first, size in groups:
        if runs and runs[-1][-1][1] == size and runs[-1][-1][0] + size == first:
            runs[-1].append((first, size))
        else:
            runs.append([(first, size)])
    ticks, labels = [], []
    for run in runs:
        first, size = run[0]
        last = run[-1][0] + size - 1
        ticks.append((first + last + 1) / 2)
        labels.append(group_label(first, size) if len(run) == 1
                      else f"ranks {first}-{last} ({len(run)} groups of SP {size})")
    return ticks, labels


THIN_SHADE = 0.45
"""How much white the lighter shade of a thin band's colours has (:func:`lighter`)."""

THIN_BAND_PX = 4.0
"""A group's band thinner than this many pixels (in the PNG) is drawn without the gap between
groups and without white micro-batch edges, which would otherwise cover it (1-rank groups at
hundreds of GPUs): its colours stay readable, and its area stays its GPU-seconds."""


def lighter(color: str, amount: float = THIN_SHADE) -> str:
    """``color`` (``#RRGGBB``) mixed with ``amount`` of white."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02X}" for c in (r, g, b))


def _draw_panel(ax: Axes, panel: GanttPanel, *, px_per_rank: float) -> bool:
    """Draw one plan; True when some band was thin (drawn in the checkerboard of shades)."""
    tl = panel.timeline
    boxes: dict[str, list[list[tuple[float, float]]]] = {k: [] for k in COLORS}
    fills: dict[str, list[str]] = {k: [] for k in COLORS}
    outlines: list[list[tuple[float, float]]] = []
    edges: list[str] = []
    any_thin = False
    for index, g in enumerate(tl.groups):
        thin = g.size * px_per_rank < THIN_BAND_PX
        any_thin |= thin
        pad = 0.0 if thin else _PAD
        y0, y1 = g.first_rank + pad, g.first_rank + g.size - pad
        for m, mb in enumerate(g.micro_batches):
            # Thin bands have no gaps or white edges: a checkerboard of shades (group by group,
            # micro-batch by micro-batch) keeps them apart instead of one block of colour.
            shade = thin and (index + m) % 2 == 1
            x = mb.start_s
            for kind, width in (("compute", mb.compute_s), ("recompute", mb.recompute_s),
                                ("alltoall", mb.alltoall_s), ("ring", mb.ring_s)):
                if width > 0:
                    boxes[kind].append(_box(x, x + width, y0, y1))
                    fills[kind].append(lighter(COLORS[kind]) if shade else COLORS[kind])
                    x += width
            outlines.append(_box(mb.start_s, mb.end_s, y0, y1))
            edges.append("none" if thin else "white")
        if tl.idle_s(g) > 0:
            boxes["idle"].append(_box(g.busy_s, tl.compute_makespan_s, y0, y1))
            fills["idle"].append(COLORS["idle"])
    if tl.grad_sync_s > 0:
        boxes["grad_sync"].append(_box(tl.compute_makespan_s, tl.step_time_s, _PAD, tl.num_ranks - _PAD))
        fills["grad_sync"].append(COLORS["grad_sync"])
    for kind, polys in boxes.items():
        if polys:
            ax.add_collection(PolyCollection(polys, facecolors=fills[kind], edgecolors="none",
                                             gid=f"{panel.key}-{kind}",
                                             hatch="//" if kind == "idle" else None))
    ax.add_collection(PolyCollection(outlines, facecolors="none", edgecolors=edges or "white", linewidths=0.8,
                                     gid=f"{panel.key}-microbatches"))
    ax.set_ylim(tl.num_ranks, 0)
    ticks, labels = group_ticks([(g.first_rank, g.size) for g in tl.groups])
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=8.0)
    ax.tick_params(axis="y", length=0)
    ax.set_ylabel("SP group (ranks)")
    shares = tl.totals_rank_s()
    total = sum(shares.values()) or 1.0
    split = ", ".join(f"{name} {shares[kind] / total:.1%}" for kind, name in (
        ("compute", "compute"), ("recompute", "recompute"), ("alltoall", "all-to-all"),
        *((("ring", "ring"),) if shares["ring"] > 0 else ()), ("idle", "idle"), ("grad_sync", "gradient sync")))
    ax.set_title(f"{panel.title}\nGPU time: {split}", loc="left")
    ax.axvline(tl.step_time_s, color="black", linewidth=1.0)
    if panel.lower_bound_s is not None and panel.lower_bound_s > 0:
        ax.axvline(panel.lower_bound_s, color="black", linewidth=1.0, linestyle="--")
    ax.grid(axis="x", color="#CCCCCC", linewidth=0.5)
    ax.set_axisbelow(True)
    return any_thin


def gantt_figure(panels: Sequence[GanttPanel], *, title: str) -> Figure:
    """The panels stacked on one time axis, with a legend of the kinds of work.

    Raises:
        ValueError: without a panel.
    """
    if not panels:
        raise ValueError("a Gantt chart needs at least one plan")
    heights = [min(9.0, max(2.2, 0.9 + 0.11 * p.timeline.num_ranks)) for p in panels]
    fig = Figure(figsize=(12.0, sum(heights) + 1.4), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    thin = False
    for ax, panel, height in zip(axes, panels, heights, strict=True):
        thin |= _draw_panel(ax, panel, px_per_rank=0.8 * height * PNG_DPI / max(panel.timeline.num_ranks, 1))
    longest = max(p.timeline.step_time_s for p in panels)
    axes[0].set_xlim(0, longest * 1.01 if longest > 0 else 1.0)
    axes[-1].set_xlabel("time from the start of the step (s)")
    handles: list[Artist] = [Patch(facecolor=COLORS[k], label=LABELS[k], hatch="//" if k == "idle" else None)
               for k in COLORS]
    handles.append(Patch(facecolor="none", edgecolor="black", linewidth=0.8,
                         label="white edge: micro-batch boundary"))
    if thin:
        handles.append(Patch(facecolor=lighter(COLORS["compute"]), edgecolor=COLORS["compute"], linewidth=0.8,
                             label="lighter shade: every other group / micro-batch (bands too thin for edges)"))
    handles.append(Line2D([], [], color="black", linewidth=1.0, label="step time"))
    if any(p.lower_bound_s for p in panels):
        handles.append(Line2D([], [], color="black", linewidth=1.0, linestyle="--", label="lower bound"))
    fig.suptitle(title, x=0.01, ha="left", fontsize=11, fontweight="bold")
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    return fig


def with_hover_titles(svg: bytes, *, key: str, titles: Sequence[str]) -> bytes:
    """The SVG with ``titles[i]`` as the ``<title>`` of the ``i``-th micro-batch path of panel
    ``key`` (hover text in a browser; the paths also take pointer events inside, not only on
    their edge).

    Raises:
        ValueError: when the panel is missing or has another number of micro-batches.
    """
    text = svg.decode("utf-8")
    start = text.find(f'<g id="{key}-microbatches">')
    if start < 0:
        raise ValueError(f"no micro-batch group {key!r} in the SVG")
    end = text.find("</g>", start)
    body = text[start:end]
    paths = body.count("<path ")
    if paths != len(titles):
        raise ValueError(f"panel {key!r} has {paths} micro-batch paths, got {len(titles)} titles")
    pieces = body.split("<path ")
    out = [pieces[0]]
    for piece, title in zip(pieces[1:], titles, strict=True):
        closed = piece.rfind("/>")
        out.append(f'<path pointer-events="all" {piece[:closed]}><title>{escape(title)}</title></path>'
                   f"{piece[closed + 2:]}")
    return (text[:start] + "".join(out) + text[end:]).encode("utf-8")
