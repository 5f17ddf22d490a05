"""A directory of video files: frames, height and width from the container metadata (PyAV).

No frame is decoded: the frame count is the stream's own (``stream.frames``) or, where the
container does not store it (Matroska, WebM), its duration times its average frame rate,
rounded (exact for constant-rate video; an estimate for variable frame rates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from costmodel.specs import Sample
from ingest.shapes import LatentScale, Layout, SkipHandler, rows_to_samples

VIDEO_SUFFIXES = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts",
                            ".flv", ".wmv", ".3gp"})
"""File suffixes taken as videos."""


def video_files(directory: Path) -> list[Path]:
    """The video files under ``directory`` (recursively, sorted, hidden files left out)."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ValueError("reading videos needs PyAV: pip install 'dcp-planner[data]'") from None
    return av


def probe_video(path: Path) -> tuple[int, int, int]:
    """``(frames, height, width)`` of the first video stream, from metadata only.

    Raises:
        ValueError: naming the file, when it cannot be opened or has no video stream.
    """
    av = _av()
    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            if not container.streams.video:
                raise ValueError(f"{path}: no video stream")
            stream = container.streams.video[0]
            frames = int(stream.frames or 0)
            if frames <= 0:
                if stream.duration is not None and stream.time_base is not None:
                    seconds = float(stream.duration * stream.time_base)
                else:
                    seconds = float(container.duration or 0) / av.time_base
                rate = float(stream.average_rate or stream.guessed_rate or 0)
                frames = round(seconds * rate)
            height, width = int(stream.codec_context.height), int(stream.codec_context.width)
    except av.error.FFmpegError as exc:
        raise ValueError(f"{path}: cannot read the video metadata ({exc.strerror or exc})") from None
    return frames, height, width


def iter_video_samples(directory: Path, *, scale: LatentScale, id_prefix: str = "",
                       on_skip: SkipHandler | None = None,
                       progress: Callable[[int, int | None], None] | None = None) -> Iterator[Sample]:
    """One 2D sample per video file under ``directory``; the id is the path relative to it.

    Raises:
        ValueError: naming the file that cannot be read (unless ``on_skip``), or when there is none.
    """
    files = video_files(directory)
    if not files:
        raise ValueError(f"{directory}: no video files ({', '.join(sorted(VIDEO_SUFFIXES))})")
    layout = Layout(kind="2d", id="id", shape=("frames", "height", "width"))
    for row, path in enumerate(files):
        try:
            frames, height, width = probe_video(path)
        except ValueError as exc:
            if on_skip is None:
                raise
            on_skip(str(exc))
        else:
            rows: dict[str, list[Any]] = {"id": [path.relative_to(directory).as_posix()], "frames": [frames],
                    "height": [height], "width": [width]}
            yield from rows_to_samples(rows, layout, first_row=row, scale=scale, id_prefix=id_prefix,
                                       source=str(path), on_skip=on_skip)
        if progress is not None:
            progress(row + 1, len(files))
