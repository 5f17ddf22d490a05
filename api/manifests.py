"""Manifests given to epoch jobs: inline JSON Lines, or a file confined to the data directory."""

from __future__ import annotations

from pathlib import Path

from api.schemas import MAX_SAMPLE_TOKENS
from costmodel.specs import Sample
from planner.workload import bounded_lines, parse_manifest_lines


class PathEscapeError(ValueError):
    """A manifest path that leaves the data directory."""


def resolve_manifest_path(data_dir: Path, relative: str) -> Path:
    """The manifest file ``relative`` under ``data_dir``, symlinks resolved.

    Raises:
        PathEscapeError: when the path (absolute, ``..`` or a symlink) leads outside.
        ValueError: when no such file exists.
    """
    root = data_dir.resolve()
    shown = _shown(relative)
    try:
        candidate = (root / relative).resolve()
        if not candidate.is_relative_to(root):
            raise PathEscapeError(f"manifest_path {shown} is outside the data directory")
        if not candidate.is_file():
            raise ValueError(f"manifest_path {shown}: no such file in the data directory")
    except (OSError, RuntimeError) as exc:  # a name too long, a symlink loop, a NUL byte
        raise ValueError(f"manifest_path {shown}: not a usable path ({type(exc).__name__})") from None
    return candidate


MAX_SHOWN_PATH_CHARS = 80
"""A path an error message names is cut to this many characters and printed escaped."""


def _shown(path: str) -> str:
    """A client's path as an error message may show it: escaped (``repr``), at most 80 characters."""
    return repr(path[:MAX_SHOWN_PATH_CHARS] + ("..." if len(path) > MAX_SHOWN_PATH_CHARS else ""))


def load_manifest(*, text: str | None, path: Path | None, max_samples: int) -> list[Sample]:
    """Parse an inline manifest or a file.

    Raises:
        ValueError: naming the line and the reason, a sample over ``MAX_SAMPLE_TOKENS``, or
            the sample count over ``max_samples``.
    """
    samples: list[Sample] = []
    if text is not None:
        lines = text.splitlines()
        source = "manifest_jsonl"
        for sample in parse_manifest_lines(lines, source=source):
            samples.append(sample)
            if len(samples) > max_samples:
                raise ValueError(f"manifest holds more than {max_samples} samples")
    else:
        assert path is not None
        with path.open() as fh:
            for sample in parse_manifest_lines(bounded_lines(fh, source=path.name), source=path.name):
                samples.append(sample)
                if len(samples) > max_samples:
                    raise ValueError(f"manifest holds more than {max_samples} samples")
    if not samples:
        raise ValueError("the manifest holds no samples")
    for index, sample in enumerate(samples):
        try:
            sample.id.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"sample {index}: id holds a lone UTF-16 surrogate (not valid Unicode)") from None
        if sample.tokens > MAX_SAMPLE_TOKENS:
            raise ValueError(f"sample {index} ({sample.id[:80]!r}) has {sample.tokens} tokens, over the "
                             f"limit of {MAX_SAMPLE_TOKENS}")
    return samples
