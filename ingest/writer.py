"""Write a manifest file: every sample once, all or nothing (a temporary file renamed at the end)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from costmodel.specs import Sample
from planner.limits import MAX_MANIFEST_SAMPLES, MAX_SAMPLE_TOKENS


@dataclass(kw_only=True, slots=True)
class ManifestStats:
    """What a written manifest holds."""

    num_samples: int = 0
    """Samples written."""
    num_2d: int = 0
    """Of them, 2D samples."""
    total_tokens: int = 0
    """Sum of the samples' tokens."""
    min_tokens: int = 0
    """Shortest sample in tokens."""
    max_tokens: int = 0
    """Longest sample in tokens."""
    token_counts: list[int] = field(default_factory=list, repr=False)
    """Every sample's tokens, in order (for percentiles)."""

    def add(self, sample: Sample) -> None:
        """Count one sample."""
        self.num_samples += 1
        self.num_2d += sample.is_2d
        self.total_tokens += sample.tokens
        self.min_tokens = sample.tokens if self.num_samples == 1 else min(self.min_tokens, sample.tokens)
        self.max_tokens = max(self.max_tokens, sample.tokens)
        self.token_counts.append(sample.tokens)


def write_manifest_file(samples: Iterable[Sample], out: Path, *, overwrite: bool = False,
                        on_skip: Callable[[str], None] | None = None) -> ManifestStats:
    """Write ``samples`` as a JSON Lines manifest at ``out``.

    The file appears only when every sample was written; on any error nothing at ``out``
    changes. The service's limits apply (``planner.limits``): a sample over
    ``MAX_SAMPLE_TOKENS``, and at most ``MAX_MANIFEST_SAMPLES`` samples.

    Args:
        samples: The samples, in order.
        out: The manifest file.
        overwrite: Replace an existing ``out``.
        on_skip: Called with the reason for each duplicate id or over-long sample, which is then
            left out (``--skip-invalid``); without it such a sample is an error.

    Raises:
        ValueError: for a duplicate id or over-long sample (without ``on_skip``), no samples,
            too many samples, or an existing ``out`` without ``overwrite``.
    """
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    stats = ManifestStats()
    seen: set[str] = set()
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"  # opened like any file: the umask applies
    try:
        with tmp.open("w") as fh:
            for sample in samples:
                problem = None
                if sample.id in seen:
                    problem = (f"sample id {sample.id!r} appears twice; ids must be unique "
                               "(choose another --id-column, or none for row numbers)")
                elif sample.tokens > MAX_SAMPLE_TOKENS:
                    problem = (f"sample {sample.id!r} has {sample.tokens:,} tokens, over the limit of "
                               f"{MAX_SAMPLE_TOKENS:,}")
                if problem is not None:
                    if on_skip is None:
                        raise ValueError(problem)
                    on_skip(problem)
                    continue
                if stats.num_samples >= MAX_MANIFEST_SAMPLES:
                    raise ValueError(f"more than {MAX_MANIFEST_SAMPLES:,} samples (the service's limit "
                                     "for one manifest)")
                seen.add(sample.id)
                fh.write(sample.model_dump_json(exclude_none=True) + "\n")
                stats.add(sample)
        if stats.num_samples == 0:
            raise ValueError("no samples to write (every row was skipped or the source is empty)")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return stats
