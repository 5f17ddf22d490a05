"""The memory chart of one plan: each group's predicted peak per rank against the cap.

One stacked bar per group (its largest micro-batch), split into the parts of
``planner.memory_view`` (model states: parameters, gradients, optimizer states; fixed working
buffers; activations kept; per-token working set), the margin to the cap as an outlined box above
it, a dot for each of the group's other micro-batches, and, where ranks reported one for this
plan, the measured peak as a black tick. Horizontal lines mark the cap and the device's memory.
Groups of one size that are alike in memory are common at scale: past ``MAX_BARS`` groups the
chart keeps, per size, the group with the highest peak and says how many it stands for.

In the SVG, the bar of part ``P`` (``params``, ``grads``, ``optimizer``, ``fixed_working``,
``activations``, ``token_working``, ``margin``) of the ``x``-th shown group is ``<g id="memory-P-x">``.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.memory_view import GroupMemory, MicroBatchMemory
from report.render import ImageFormat, render

PARTS: tuple[tuple[str, str, str], ...] = (
    ("params_bytes", "parameters (bf16)", "#4C78A8"),
    ("grads_bytes", "gradients (bf16)", "#72B7B2"),
    ("optimizer_bytes", "optimizer states (fp32 master + Adam)", "#54A24B"),
    ("fixed_working_bytes", "fixed buffers", "#B279A2"),
    ("activations_bytes", "activations kept", "#F58518"),
    ("token_working_bytes", "per-token working set", "#E45756"),
)
"""(field of ``MicroBatchMemory``, legend, colour) from the bottom of a bar up."""

MAX_BARS = 48
"""Past this many groups, one bar per group size (the size's highest peak)."""

GIB = 1024.0**3


def _shown(groups: Sequence[GroupMemory]) -> list[tuple[GroupMemory, int]]:
    """The groups drawn, each with how many groups it stands for."""
    working = [g for g in groups if g.micro_batches]
    if len(working) <= MAX_BARS:
        return [(g, 1) for g in working]
    by_size: dict[int, list[GroupMemory]] = {}
    for g in working:
        by_size.setdefault(g.size, []).append(g)
    return [(max(members, key=lambda g: g.peak_bytes), len(members))
            for _, members in sorted(by_size.items())]


def memory_figure(groups: Sequence[GroupMemory], *, title: str, hbm_bytes: float) -> Figure:
    """The chart (module docstring) of ``planner.memory_view.plan_memory``'s groups."""
    shown = _shown(groups)
    fig = Figure(figsize=(12, 5.2), layout="constrained")
    ax = fig.add_subplot()
    xs = list(range(len(shown)))
    worst: list[MicroBatchMemory] = [max(g.micro_batches, key=lambda mb: mb.peak_bytes) for g, _ in shown]
    bottom = [0.0] * len(shown)
    for field, label, color in PARTS:
        heights = [getattr(mb, field) / GIB for mb in worst]
        bars = ax.bar(xs, heights, bottom=bottom, color=color, width=0.75, label=label)
        for x, rect in zip(xs, bars.patches, strict=True):
            rect.set_gid(f"memory-{field.removesuffix('_bytes')}-{x}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    cap_gib = worst[0].cap_bytes / GIB if worst else 0.0
    margins = [max(mb.margin_bytes, 0.0) / GIB for mb in worst]
    boxes = ax.bar(xs, margins, bottom=bottom, fill=False, edgecolor="#999999", linestyle=":", width=0.75,
                   label="margin to the cap")
    for x, rect in zip(xs, boxes.patches, strict=True):
        rect.set_gid(f"memory-margin-{x}")
    for x, (g, _) in zip(xs, shown, strict=True):
        others = [mb.peak_bytes / GIB for mb in g.micro_batches]
        ax.plot([x] * len(others), others, linestyle="none", marker="o", markersize=2.5, color="#333333",
                label="peak of each micro-batch" if x == 0 else "_nolegend_")
        if g.measured_peak_bytes is not None:
            ax.plot([x - 0.38, x + 0.38], [g.measured_peak_bytes / GIB] * 2, color="black", linewidth=2.0)
    ax.axhline(cap_gib, color="#D62728", linewidth=1.2)
    ax.axhline(hbm_bytes / GIB, color="#7F7F7F", linewidth=1.0, linestyle="--")
    labels = [(f"{g.first_rank}-{g.first_rank + g.size - 1}" if g.size > 1 else f"{g.first_rank}")
              + (f"\n(x{n} of d={g.size})" if n > 1 else "") for g, n in shown]
    ax.set_xticks(xs, labels, rotation=90 if len(xs) > 16 else 0, fontsize=7 if len(xs) > 16 else 8)
    ax.set_xlabel("group (ranks)" + ("; one bar per size, its highest peak" if any(n > 1 for _, n in shown)
                                     else ""))
    ax.set_ylabel("GiB per rank")
    ax.set_title(title, loc="left")
    handles, names = ax.get_legend_handles_labels()
    handles += [Patch(color="#D62728", label=f"memory cap {cap_gib:.1f} GiB"),
                Patch(color="#7F7F7F", label=f"device memory {hbm_bytes / GIB:.1f} GiB")]
    names += [h.get_label() for h in handles[-2:]]
    if any(g.measured_peak_bytes is not None for g, _ in shown):
        handles.append(Patch(color="black", label="measured peak"))
        names.append("measured peak")
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_ylim(0, max(hbm_bytes / GIB, max(bottom, default=0.0)) * 1.05)
    return fig


def memory_image(groups: Sequence[GroupMemory], *, title: str, hbm_bytes: float, fmt: ImageFormat) -> bytes:
    """:func:`memory_figure` as PNG or SVG bytes."""
    return render(lambda: memory_figure(groups, title=title, hbm_bytes=hbm_bytes), fmt)
