"""Datasets in: build a manifest (sample ids and shapes) from the data a user already has.

Sources (``dcp manifest``): a table (Parquet, JSON Lines, Arrow/Feather, CSV; a file or a
directory of shards) read with pyarrow; a directory of video files read with PyAV (container
metadata only); a Hugging Face ``datasets`` dataset saved with ``save_to_disk``. Only the id and
shape columns are read. The manifest format is the planner's (``planner/workload.py``): JSON
Lines, ``{"id": "a", "tokens": 812}`` or ``{"id": "v", "frames": 15, "height": 22, "width": 40,
"tokens": 13200}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from costmodel.specs import Sample
from ingest.hf import is_hf_dataset, iter_hf_samples
from ingest.shapes import Columns, Kind, LatentScale, SkipHandler
from ingest.tables import iter_table_samples
from ingest.videos import iter_video_samples, video_files
from ingest.writer import ManifestStats, write_manifest_file

SourceKind = Literal["table", "videos", "hf"]

__all__ = ["Columns", "LatentScale", "ManifestStats", "SourceKind", "detect_source", "iter_samples",
           "write_manifest_file"]


def detect_source(path: Path) -> SourceKind:
    """What ``path`` is: a saved Hugging Face dataset, a directory of videos, or a table.

    Raises:
        ValueError: when the path does not exist.
    """
    if not path.exists():
        raise ValueError(f"SOURCE {path}: no such file or directory")
    if path.is_dir() and is_hf_dataset(path):
        return "hf"
    if path.is_dir() and video_files(path):
        return "videos"
    return "table"


def iter_samples(path: Path, *, source: SourceKind | None = None, columns: Columns = Columns(),
                 kind: Kind | None = None, scale: LatentScale | None = None, split: str | None = None,
                 id_prefix: str = "", on_skip: SkipHandler | None = None,
                 progress: Callable[[int, int | None], None] | None = None) -> Iterator[Sample]:
    """The samples of a dataset at ``path`` (kind detected unless ``source`` is given).

    Raises:
        ValueError: naming the option or the row at fault; a video directory needs ``scale``.
    """
    source = source or detect_source(path)
    if source == "videos":
        if scale is None:
            raise ValueError("a directory of videos needs --temporal-compression and "
                             "--spatial-compression (e.g. 4 and 16: a 4x8x8 VAE with 2x2 patches)")
        return iter_video_samples(path, scale=scale, id_prefix=id_prefix, on_skip=on_skip,
                                  progress=progress)
    if split is not None and source != "hf":
        raise ValueError(f"--split {split!r}: only a saved Hugging Face dataset has splits")
    scale = scale or LatentScale()
    if source == "hf":
        return iter_hf_samples(path, split=split, columns=columns, kind=kind, scale=scale,
                               id_prefix=id_prefix, on_skip=on_skip, progress=progress)
    return iter_table_samples(path, columns=columns, kind=kind, scale=scale, id_prefix=id_prefix,
                              on_skip=on_skip, progress=progress)
