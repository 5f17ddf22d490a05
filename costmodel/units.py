"""Numbers as people read them in messages: bytes in binary units."""

from __future__ import annotations

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def fmt_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it at 1 or more, 3 significant digits.

    ``fmt_bytes(1.03732e11)`` is ``'96.6 GiB'``, ``fmt_bytes(3 * 2**20)`` ``'3.00 MiB'``,
    ``fmt_bytes(512)`` ``'512 B'``; a negative value keeps its sign.
    """
    size = abs(float(num_bytes))
    sign = "-" if num_bytes < 0 else ""
    for unit, scale in _UNITS:
        if size >= scale:
            value = size / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{sign}{value:.{digits}f} {unit}"
    return f"{sign}{size:.0f} B"
