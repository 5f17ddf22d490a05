"""One plan as a self-contained HTML page: its Gantt and memory charts inline as SVG, so a
browser shows each micro-batch's hover text (group, time, samples, tokens, peak memory)."""

from __future__ import annotations

import html


def plan_html(*, title: str, gantt_svg: bytes, memory_svg: bytes | None = None) -> str:
    """The page (no request outside it: the SVGs are inline, the style is in the page)."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        '<link rel="icon" href="data:,">',
        "<style>body{font-family:system-ui,sans-serif;margin:1rem 2rem;color:#222}"
        "svg{max-width:100%;height:auto}p{font-size:.9rem;color:#555}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p>Hover a micro-batch for its group, predicted time, samples, tokens and peak memory.</p>",
        _inline(gantt_svg),
    ]
    if memory_svg is not None:
        parts += ["<h2>Predicted peak memory per rank</h2>", _inline(memory_svg)]
    parts.append("</body></html>")
    return "\n".join(parts)


def _inline(svg: bytes) -> str:
    """The SVG element of a rendered file, without its XML prologue and doctype."""
    text = svg.decode("utf-8")
    return text[text.index("<svg"):]
