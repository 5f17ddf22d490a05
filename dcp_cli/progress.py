"""Progress bars of the long commands (rich, on stderr; none with ``--quiet``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

Update = Callable[[int, int | None], None]
"""``update(done, total)``: ``total=None`` while the total is unknown."""


def make_progress(*, quiet: bool = False, transient: bool = False) -> Progress:
    """A rich progress display on stderr: description, bar, done/total, elapsed and remaining time."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                    transient=transient, disable=quiet)


@contextmanager
def progress_bar(description: str, *, quiet: bool = False, total: int | None = None) -> Iterator[Update]:
    """One progress bar; yields ``update(done, total)``."""
    with make_progress(quiet=quiet, transient=True) as progress:
        task = progress.add_task(description, total=total)

        def update(done: int, new_total: int | None = None) -> None:
            progress.update(task, completed=done, total=new_total if new_total is not None else total)

        yield update
