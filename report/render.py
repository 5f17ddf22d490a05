"""Rendering matplotlib figures to PNG or SVG bytes: Agg backend, no pyplot, one figure at a time.

Figures are built as ``matplotlib.figure.Figure`` objects (no global pyplot state) and rendered
under one lock with fixed settings (text kept as text in SVG, a fixed hash salt and no date,
so the same figure gives the same bytes).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib import rc_context
from matplotlib.figure import Figure

from report.figures import FORMATS, ImageFormat

PNG_DPI = 110
"""Resolution of PNG images (a 12-inch-wide figure is 1,320 pixels)."""

_RC: dict[str, Any] = {
    "svg.fonttype": "none",  # text stays text: smaller files, searchable labels
    "svg.hashsalt": "dcp-report",  # stable element ids
    "font.size": 9.0,
    "axes.titlesize": 10.0,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
}

_LOCK = threading.Lock()
"""matplotlib's global state (rcParams, font cache) is not thread-safe: one render at a time."""


def render(build: Callable[[], Figure], fmt: ImageFormat) -> bytes:
    """Build a figure and render it.

    Args:
        build: Makes the figure (called under the lock, with the report's settings).
        fmt: ``png`` or ``svg``.

    Raises:
        ValueError: for another format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    with _LOCK, rc_context(_RC):  # type: ignore[arg-type]
        fig = build()
        buf = io.BytesIO()
        metadata = {"Date": None} if fmt == "svg" else {"Software": "dcp-planner"}
        fig.savefig(buf, format=fmt, dpi=PNG_DPI, metadata=metadata)
    return buf.getvalue()
