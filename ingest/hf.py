"""A Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (memory-mapped Arrow files).

``datasets.load_from_disk`` maps the files; only the id and shape columns are selected and
read, as Arrow batches, so the payload columns stay on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from costmodel.specs import Sample
from ingest.shapes import Columns, Kind, LatentScale, SkipHandler, resolve_layout, rows_to_samples

BATCH_ROWS = 65_536
"""Rows converted per batch."""


def is_hf_dataset(directory: Path) -> bool:
    """True for a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (directory / "state.json").is_file() or (directory / "dataset_dict.json").is_file()


def _load(directory: Path, split: str | None) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError("reading a Hugging Face dataset needs datasets: "
                         "pip install 'dcp-planner[data]'") from None
    datasets.disable_progress_bars()
    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split is None:
            raise ValueError(f"{directory} holds the splits {', '.join(splits)}; name one with --split")
        if split not in loaded:
            raise ValueError(f"--split {split!r}: {directory} holds the splits {', '.join(splits)}")
        return loaded[split]
    if split is not None:
        raise ValueError(f"--split {split!r}: {directory} is a single dataset without splits")
    return loaded


def iter_hf_samples(directory: Path, *, split: str | None = None, columns: Columns = Columns(),
                    kind: Kind | None = None, scale: LatentScale = LatentScale(), id_prefix: str = "",
                    on_skip: SkipHandler | None = None,
                    progress: Callable[[int, int | None], None] | None = None) -> Iterator[Sample]:
    """Samples of a saved Hugging Face dataset (one split of a ``DatasetDict``).

    Raises:
        ValueError: naming ``--split`` or the option of a missing column, or the bad row.
    """
    dataset = _load(directory, split)
    source = f"{directory}" + (f" [{split}]" if split else "")
    layout = resolve_layout(dataset.column_names, columns, kind=kind, source=source)
    subset = dataset.select_columns(layout.names).with_format("arrow")
    done = 0
    for batch in subset.iter(batch_size=BATCH_ROWS):
        yield from rows_to_samples(batch.to_pydict(), layout, first_row=done, scale=scale,
                                   id_prefix=id_prefix, source=source, on_skip=on_skip)
        done += batch.num_rows
        if progress is not None:
            progress(done, len(dataset))
