"""From dataset columns to manifest samples: which columns hold what, and pixels to latent patches.

A 1D row gives a length in tokens (an integer column, or a list column such as ``input_ids``
whose length is taken). A 2D row gives frames x height x width; a video's pixels become
latent patches with ``LatentScale``::

    frames_used   = min(ceil(frames / frame_stride), max_frames)
    latent frames = ceil(frames_used / temporal_compression)
    latent height = ceil(height / spatial_compression)     # VAE factor x patch size
    latent width  = ceil(width / spatial_compression)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from costmodel.specs import Sample

Kind = Literal["1d", "2d"]
SkipHandler = Callable[[str], None]
"""Called with the reason for each row skipped; without one, a bad row raises ``ValueError``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Columns:
    """Which dataset columns hold a sample's id and shape; ``None`` means the default name."""

    id: str | None = None
    """Stable id of the sample (default ``id`` when present, else the row number)."""
    tokens: str | None = None
    """1D length in tokens, or a list column whose length is taken (default ``tokens``)."""
    frames: str | None = None
    """2D frames (default ``frames``)."""
    height: str | None = None
    """2D height in pixels or patches (default ``height``)."""
    width: str | None = None
    """2D width in pixels or patches (default ``width``)."""


# (field of Columns, default column name, the option a user sets it with)
COLUMN_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("id", "id", "--id-column"),
    ("tokens", "tokens", "--tokens-column"),
    ("frames", "frames", "--frames-column"),
    ("height", "height", "--height-column"),
    ("width", "width", "--width-column"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class LatentScale:
    """How a 2D source's frames and pixels become the model's latent patches (1 = unchanged)."""

    frame_stride: int = 1
    """Every n-th frame is used (a frame rate reduction)."""
    max_frames: int | None = None
    """Frames used at most, after the stride (clips are cut to this length)."""
    temporal_compression: int = 1
    """Frames per latent frame (the VAE's temporal factor)."""
    spatial_compression: int = 1
    """Pixels per latent patch side: the VAE's spatial factor times the patch size (8 x 2 = 16)."""

    def __post_init__(self) -> None:
        for name in ("frame_stride", "temporal_compression", "spatial_compression"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be at least 1, got {self.max_frames}")

    def latent(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Latent ``(frames, height, width)`` of a clip of ``frames`` x ``height`` x ``width``."""
        used = math.ceil(frames / self.frame_stride)
        if self.max_frames is not None:
            used = min(used, self.max_frames)
        return (math.ceil(used / self.temporal_compression), math.ceil(height / self.spatial_compression),
                math.ceil(width / self.spatial_compression))


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """The resolved columns of one source: real column names, and 1D or 2D."""

    kind: Kind
    id: str | None
    """The id column, or ``None`` for row numbers."""
    shape: tuple[str, ...]
    """``(tokens,)`` for 1D, ``(frames, height, width)`` for 2D."""

    @property
    def names(self) -> list[str]:
        """Every column to read."""
        return [*([self.id] if self.id else []), *self.shape]


def resolve_layout(available: Sequence[str], columns: Columns, *, kind: Kind | None,
                   source: str) -> Layout:
    """Pick the columns to read from a source that has ``available`` columns.

    ``kind=None`` means 2D when the frames, height and width columns are there, else 1D.

    Raises:
        ValueError: naming the option of a column that is missing, and the columns there are.
    """
    names: dict[str, str] = {}
    for field, default, option in COLUMN_OPTIONS:
        given = getattr(columns, field)
        if given is not None and given not in available:
            raise ValueError(f"{option} {given!r}: no such column in {source}; "
                             f"columns: {', '.join(available)}")
        names[field] = given if given is not None else default
    dims = ("frames", "height", "width")
    if kind is None:
        kind = "2d" if all(names[d] in available for d in dims) else "1d"
    wanted = dims if kind == "2d" else ("tokens",)
    for field in wanted:
        if names[field] not in available:
            option = next(o for f, _, o in COLUMN_OPTIONS if f == field)
            raise ValueError(f"{source} has no column {names[field]!r} for the {kind.upper()} "
                             f"{field}; name it with {option} (columns: {', '.join(available)})")
    id_column = names["id"] if names["id"] in available else None
    return Layout(kind=kind, id=id_column, shape=tuple(names[f] for f in wanted))


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def rows_to_samples(columns: dict[str, list[Any]], layout: Layout, *, first_row: int,
                    scale: LatentScale, id_prefix: str = "", source: str,
                    on_skip: SkipHandler | None = None) -> Iterator[Sample]:
    """Samples of one batch of rows (``columns`` maps a column name to its Python values).

    A list value in the 1D length column counts its items (token ids). Row numbers in messages
    start at 0, counted over the whole source.

    Raises:
        ValueError: naming the source, the row, the column and the value (unless ``on_skip``).
    """
    num_rows = len(columns[layout.shape[0]])
    ids = columns[layout.id] if layout.id else None
    for i in range(num_rows):
        row = first_row + i
        raw_id = ids[i] if ids is not None else row
        values = [columns[name][i] for name in layout.shape]
        if layout.kind == "1d" and isinstance(values[0], list | tuple):
            values = [len(values[0]) or None]
        dims = [_positive_int(v) for v in values]
        problem = None
        if raw_id is None:
            problem = f"row {row}: column {layout.id!r} is empty"
        for name, value, dim in zip(layout.shape, values, dims, strict=True):
            if problem is None and dim is None:
                problem = f"row {row}: column {name!r} is {value!r}, not a positive integer"
        if problem is None:
            record: dict[str, Any] = {"id": f"{id_prefix}{raw_id}"}
            if layout.kind == "1d":
                record["tokens"] = dims[0]
            else:
                f, h, w = scale.latent(*dims)  # type: ignore[arg-type]
                record.update(frames=f, height=h, width=w)
            try:
                yield Sample.model_validate(record)
                continue
            except ValidationError as exc:
                first = exc.errors()[0]
                problem = f"row {row}: {'.'.join(str(p) for p in first['loc']) or 'sample'}: {first['msg']}"
        if on_skip is None:
            raise ValueError(f"{source}: {problem}")
        on_skip(problem)
