"""What the service benchmarks' entry points share: the parser with ``--out``, console logging,
and the machine load they record before and after a run."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from provenance import default_out  # bench/ (the script's folder) is on sys.path


def parser_with_out(description: str | None, name: str) -> argparse.ArgumentParser:
    """An argument parser that shows ``description`` (the script's docstring) as written, with
    ``--out`` (default :func:`provenance.default_out` of ``name``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    out = default_out(name)
    parser.add_argument("--out", type=Path, default=out, help=f"Where the JSON goes (default {out}).")
    return parser


def log_to_console(*, quiet: bool = False) -> None:
    """Log lines as bare messages on the console (INFO, or WARNING when ``quiet``), without
    httpx's line per request."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 2 decimals (a JSON's ``loadavg_*``)."""
    return [round(x, 2) for x in os.getloadavg()]
