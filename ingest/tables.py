"""Tabular datasets (Parquet, JSON Lines, Arrow/Feather, CSV; a file or a directory of shards).

Read with pyarrow, projecting to the id and shape columns only: ``pyarrow.dataset`` never reads
the other columns of Parquet and Arrow files (the payload), and the streaming JSON reader is
given an explicit schema of just those fields, so that it skips the rest instead of building
them (a payload whose type changes from row to row is no error).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from costmodel.specs import Sample
from ingest.shapes import Columns, Kind, LatentScale, Layout, SkipHandler, resolve_layout, rows_to_samples

TABLE_FORMATS: dict[str, str] = {
    ".parquet": "parquet", ".pq": "parquet",
    ".jsonl": "json", ".ndjson": "json", ".json": "json",
    ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc",
    ".csv": "csv",
}
"""File suffix -> pyarrow.dataset format."""

BATCH_ROWS = 65_536
"""Rows converted per batch (bounds the memory of the id and shape columns)."""

ProgressFn = Callable[[int, int | None], None]
"""Called with (rows done, rows in total or None when unknown without a full read)."""


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.dataset
    except ImportError:
        raise ValueError("reading tables needs pyarrow: pip install 'dcp-planner[data]'") from None
    return pyarrow


def table_files(source: Path) -> tuple[list[Path], str]:
    """The data files of a table source and their pyarrow format.

    Raises:
        ValueError: when the files are of no known format, or of several.
    """
    if source.is_file():
        files = [source]
    else:
        files = sorted(p for p in source.rglob("*") if p.is_file() and not p.name.startswith((".", "_"))
                       and p.suffix.lower() in TABLE_FORMATS)
    formats = {TABLE_FORMATS.get(p.suffix.lower()) for p in files}
    if not files or None in formats:
        known = ", ".join(sorted(TABLE_FORMATS))
        raise ValueError(f"{source}: not a table of a known format (file suffixes {known})")
    if len(formats) > 1:
        raise ValueError(f"{source} mixes formats {sorted(f for f in formats if f)}; point at one kind")
    return files, formats.pop()  # type: ignore[return-value]


def _json_first_record(files: list[Path]) -> dict[str, Any]:
    for path in files:
        with path.open() as fh:
            for number, line in enumerate(fh, start=1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{number}: not JSON Lines ({exc.msg})") from None
                    if not isinstance(record, dict):
                        raise ValueError(f"{path}:{number}: a JSON Lines row must be an object")
                    return record
    raise ValueError(f"{files[0]}: no rows")


def _json_type(pa: Any, value: Any) -> Any:
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, list):
        return pa.list_(pa.int64())
    return pa.string()


def _batches(files: list[Path], fmt: str, columns: Columns, kind: Kind | None,
             source: str) -> tuple[Iterator[Any], Layout, int | None]:
    """Record batches of the id and shape columns, the layout, and the row count where cheap."""
    pa = _pyarrow()
    import pyarrow.dataset as ds

    if fmt != "json":
        dataset = ds.dataset([str(p) for p in files], format=fmt)
        layout = resolve_layout(dataset.schema.names, columns, kind=kind, source=source)
        total = dataset.count_rows() if fmt in ("parquet", "ipc") else None
        return dataset.to_batches(columns=layout.names, batch_size=BATCH_ROWS), layout, total
    import pyarrow.json as pj

    first = _json_first_record(files)
    layout = resolve_layout(list(first), columns, kind=kind, source=source)
    # Only the wanted fields get a type; the parser skips every other field (the payload).
    schema = pa.schema([(name, _json_type(pa, first[name])) for name in layout.names])
    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")

    def stream() -> Iterator[Any]:
        for path in files:
            yield from pj.open_json(path, parse_options=parse)

    return stream(), layout, None


def iter_table_samples(source: Path, *, columns: Columns = Columns(), kind: Kind | None = None,
                       scale: LatentScale = LatentScale(), id_prefix: str = "",
                       on_skip: SkipHandler | None = None,
                       progress: ProgressFn | None = None) -> Iterator[Sample]:
    """Samples of a table file or directory of shards, in file and row order.

    Args:
        source: A file, or a directory whose files of one format are read in sorted order.
        columns: Column names (defaults: the manifest's field names).
        kind: ``"1d"``, ``"2d"`` or ``None`` (2D when frames, height and width columns exist).
        scale: Pixels to latent patches for 2D rows.
        id_prefix: Prepended to every id (row numbers are used when there is no id column).
        on_skip: Called for each bad row instead of raising.
        progress: Called after each batch.

    Raises:
        ValueError: naming the option of a missing column, or the bad row.
    """
    files, fmt = table_files(source)
    batches, layout, total = _batches(files, fmt, columns, kind, str(source))
    try:
        done = 0
        for batch in batches:
            data = batch.to_pydict()
            yield from rows_to_samples(data, layout, first_row=done, scale=scale, id_prefix=id_prefix,
                                       source=str(source), on_skip=on_skip)
            done += batch.num_rows
            if progress is not None:
                progress(done, total)
    except _pyarrow().lib.ArrowInvalid as exc:
        raise ValueError(f"{source}: {str(exc).splitlines()[0]}") from None
