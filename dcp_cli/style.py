"""How the ``dcp`` commands show numbers and errors: one place, so every table reads alike."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

GIB = 1024**3
WIDTH = 80
"""Tables are laid out to fit this many columns when the terminal is not wider."""


def fail(message: str) -> NoReturn:
    """Stop the command with a usage error (exit 2) that says what to change."""
    raise typer.BadParameter(message)


def require_parent(path: Path, *, option: str) -> None:
    """Stop (exit 2) when the directory that would hold the output ``path`` does not exist: an
    output goes where the user made room for it, so a mistyped path never creates a tree of
    directories (nor writes under ``/``)."""
    parent = path.parent
    if not parent.is_dir():
        fail(f"{option} {path}: the directory {parent} does not exist; create it first, or give a path "
             "in an existing directory")


def fmt_count(value: int) -> str:
    """``1234567`` -> ``1,234,567``."""
    return f"{value:,}"


def fmt_ms(seconds: float) -> str:
    """Milliseconds with 3-4 significant digits and no exponent: ``0.123``, ``12.3``, ``12,345``."""
    ms = seconds * 1e3
    if ms >= 1000:
        return f"{ms:,.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    if ms >= 0.1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_s(seconds: float) -> str:
    """Seconds with 3 decimals (``0.988``, ``11.680``), 1 from 100 s on (``1,234.5``)."""
    return f"{seconds:,.1f}" if seconds >= 100 else f"{seconds:.3f}"


def fmt_gib(num_bytes: float) -> str:
    """Bytes as GiB with 2 decimals (3 significant digits under 0.01 GiB)."""
    gib = num_bytes / GIB
    return f"{gib:.2f}" if gib >= 0.01 or gib == 0 else f"{gib:.3g}"


def fmt_pct(fraction: float) -> str:
    """``0.0123`` -> ``1.23%``."""
    return f"{fraction:.2%}"


def fmt_x(ratio: float) -> str:
    """A speedup: ``1.234`` -> ``1.23x``."""
    return f"{ratio:.2f}x"


def legend(entries: list[tuple[str, str]]) -> Table:
    """A column legend: one ``name  meaning`` line per column, meanings wrapped and aligned."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for name, meaning in entries:
        grid.add_row(name, meaning)
    return grid


def console() -> Console:
    """A stdout console at least ``WIDTH`` wide (pipes and tests get 80 columns, not less)."""
    out = Console()
    if not out.is_terminal:
        out.width = max(out.width, WIDTH)
    return out


def print_table(table: Table, entries: list[tuple[str, str]], *, out: Console | None = None) -> None:
    """Print a table and its legend below it."""
    (out or console()).print(Group(table, Text("Columns:", style="bold"), legend(entries)))
