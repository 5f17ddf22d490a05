"""Workloads: reproducible global batches from benchmark specs, and real dataset manifests.

A benchmark spec (``dcp-workload/1``, see ``costmodel/presets/workloads``) is either 2D
(``buckets`` of latent frames x height x width with sampling weights) or 1D (a token-length
``distribution``: lognormal with median and sigma, or log-uniform, clipped to bounds, or a
``mixture`` of those with weights, e.g. a long tail plus a share of 256k-1M-token documents).

A manifest is JSON Lines, one sample per line: ``{"id": "a", "tokens": 812}`` or
``{"id": "v1", "frames": 15, "height": 22, "width": 40}``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, TextIO

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from costmodel.presets import load_workload_spec
from costmodel.specs import Sample
from planner.limits import MAX_SAMPLE_TOKENS


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Bucket(_Frozen):
    """A 2D shape bucket with its sampling weight."""

    name: str
    frames: int = Field(gt=0)
    height: int = Field(gt=0)
    width: int = Field(gt=0)
    weight: float = Field(ge=0)


class LengthDistribution(_Frozen):
    """A 1D token-length distribution."""

    type: Literal["lognormal", "loguniform", "mixture"]
    min_tokens: int = Field(gt=0)
    max_tokens: int = Field(gt=0)
    median_tokens: float | None = Field(default=None, gt=0)
    sigma: float | None = Field(default=None, gt=0)
    components: list[MixtureComponent] | None = None
    """``mixture`` only: the distributions drawn from, each with its weight (each sample picks
    one component by weight, then its length from it); their bounds lie inside this one's."""

    @model_validator(mode="after")
    def _check(self) -> LengthDistribution:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        if self.type == "lognormal" and (self.median_tokens is None or self.sigma is None):
            raise ValueError("a lognormal distribution needs median_tokens and sigma")
        if (self.type == "mixture") != bool(self.components):
            raise ValueError(f"a {self.type} distribution "
                             + ("needs components" if self.type == "mixture" else "takes no components"))
        for c in self.components or []:
            if c.type == "mixture":
                raise ValueError("a mixture component cannot itself be a mixture")
            if c.min_tokens < self.min_tokens or c.max_tokens > self.max_tokens:
                raise ValueError(f"mixture component [{c.min_tokens}, {c.max_tokens}] lies outside the "
                                 f"mixture's bounds [{self.min_tokens}, {self.max_tokens}]")
        if self.components and sum(c.weight for c in self.components) <= 0:
            raise ValueError("mixture component weights sum to 0")
        return self


class MixtureComponent(LengthDistribution):
    """One component of a ``mixture``: a distribution and its sampling weight."""

    weight: float = Field(ge=0)


LengthDistribution.model_rebuild()  # ``components`` names the subclass defined after it


class WorkloadSpec(_Frozen):
    """A benchmark workload (``schema: dcp-workload/1``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    schema_: Literal["dcp-workload/1"] = Field(alias="schema")
    name: str
    kind: Literal["1d", "2d", "3d"]
    """1d: token lengths from ``distribution``; 2d and 3d (video latents in patches): ``buckets``."""
    model: str
    description: str = ""
    buckets: list[Bucket] | None = None
    distribution: LengthDistribution | None = None

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.kind != "1d" and not self.buckets:
            raise ValueError(f"{self.kind} workload {self.name!r} has no buckets")
        if self.kind == "1d" and self.distribution is None:
            raise ValueError(f"1d workload {self.name!r} has no distribution")
        if self.buckets and sum(b.weight for b in self.buckets) <= 0:
            raise ValueError(f"workload {self.name!r}: bucket weights sum to 0")
        return self

    @classmethod
    def preset(cls, name: str) -> WorkloadSpec:
        """Load a shipped workload preset by name."""
        return cls.model_validate(load_workload_spec(name))

    @property
    def max_sample(self) -> Sample:
        """The largest sample the workload can produce."""
        if self.kind != "1d":
            assert self.buckets is not None
            b = max(self.buckets, key=lambda b: b.frames * b.height * b.width)
            return Sample(id=f"{self.name}:max", frames=b.frames, height=b.height, width=b.width,
                          tokens=b.frames * b.height * b.width)
        assert self.distribution is not None
        return Sample(id=f"{self.name}:max", tokens=self.distribution.max_tokens)


def _draw(spec: WorkloadSpec, rng: np.random.Generator, count: int) -> list[dict[str, int]]:
    if spec.kind != "1d":
        assert spec.buckets is not None
        weights = np.array([b.weight for b in spec.buckets], dtype=np.float64)
        picks = rng.choice(len(spec.buckets), size=count, p=weights / weights.sum())
        return [{"frames": spec.buckets[i].frames, "height": spec.buckets[i].height,
                 "width": spec.buckets[i].width} for i in picks]
    assert spec.distribution is not None
    return [{"tokens": int(t)} for t in _draw_tokens(spec.distribution, rng, count)]


def _draw_tokens(dist: LengthDistribution, rng: np.random.Generator, count: int) -> np.ndarray:
    if dist.type == "mixture":
        assert dist.components is not None
        weights = np.array([c.weight for c in dist.components], dtype=np.float64)
        picks = rng.choice(len(dist.components), size=count, p=weights / weights.sum())
        tokens = np.empty(count, dtype=np.int64)
        for j, component in enumerate(dist.components):  # in component order: reproducible
            where = np.flatnonzero(picks == j)
            tokens[where] = _draw_tokens(component, rng, len(where))
        return tokens
    lo, hi = np.log(dist.min_tokens), np.log(dist.max_tokens)
    if dist.type == "lognormal":
        assert dist.median_tokens is not None and dist.sigma is not None
        logs = rng.normal(np.log(dist.median_tokens), dist.sigma, size=count)
    else:
        logs = rng.uniform(lo, hi, size=count)
    return np.clip(np.rint(np.exp(logs)), dist.min_tokens, dist.max_tokens).astype(np.int64)


def sample_batch(spec: WorkloadSpec, *, num_samples: int, seed: int, step: int = 0) -> list[Sample]:
    """Draw one reproducible global batch.

    Args:
        spec: The workload.
        num_samples: Samples in the batch.
        seed: Seed of the run; the batch of (seed, step) is always the same.
        step: Step index.

    Returns:
        Samples with ids ``<workload>:<seed>:<step>:<i>``.
    """
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    rng = np.random.default_rng([seed, step])
    return [Sample(id=f"{spec.name}:{seed}:{step}:{i}", **shape)
            for i, shape in enumerate(_draw(spec, rng, num_samples))]


def synthesize_manifest(spec: WorkloadSpec, *, num_samples: int, seed: int) -> list[Sample]:
    """A reproducible synthetic dataset of ``num_samples`` samples (ids ``<workload>-<i>``)."""
    if num_samples <= 0:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    rng = np.random.default_rng(seed)
    return [Sample(id=f"{spec.name}-{i}", **shape) for i, shape in enumerate(_draw(spec, rng, num_samples))]


def parse_manifest_lines(lines: Iterable[str], *, source: str = "<manifest>") -> Iterator[Sample]:
    """Parse JSON Lines into samples; blank lines are skipped.

    The one reading of a manifest line, for the CLI and the service alike: numbers must be JSON
    integers (``"tokens": "12"`` and ``12.0`` are refused, as the API's plan requests refuse
    them), an integer id becomes its decimal string, and a sample over
    ``planner.limits.MAX_SAMPLE_TOKENS`` is refused.

    Raises:
        ValueError: naming the source, the line number and the reason; also for duplicate ids.
    """
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}:{number}: not JSON ({exc.msg})") from None
        if isinstance(record, dict) and "id" in record and not isinstance(record["id"], str):
            record["id"] = str(record["id"])
        try:
            sample = Sample.model_validate(record, strict=True)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "sample"
            raise ValueError(f"{source}:{number}: {field}: {first['msg']} (got {_json_kind(first.get('input'))})"
                             ) from None
        if sample.tokens > MAX_SAMPLE_TOKENS:
            raise ValueError(f"{source}:{number}: sample {sample.id[:80]!r} has {sample.tokens:,} tokens, "
                             f"over the limit of {MAX_SAMPLE_TOKENS:,}")
        if sample.id in seen:
            raise ValueError(f"{source}:{number}: duplicate sample id {sample.id!r}")
        seen.add(sample.id)
        yield sample


MAX_MANIFEST_LINE_CHARS = 64 * 1024
"""Longest line of a manifest (a sample's line is well under 1 KB): a longer one is refused as
soon as that many characters are read, not after the whole line (a 50 MB file of one line) is."""


def bounded_lines(fh: TextIO, *, source: str, max_chars: int = MAX_MANIFEST_LINE_CHARS) -> Iterator[str]:
    """The lines of ``fh``, none read past ``max_chars`` characters.

    Raises:
        ValueError: naming the source and the line number of a longer line.
    """
    for number in itertools.count(1):
        line = fh.readline(max_chars + 1)
        if not line:
            return
        if len(line) > max_chars and not (len(line) == max_chars + 1 and line.endswith("\n")):
            raise ValueError(f"{source}:{number}: line longer than {max_chars:,} characters "
                             "(not a JSON Lines manifest of samples?)")
        yield line


def _json_kind(value: object) -> str:
    """What a refused manifest value is, without its content (a file that is no manifest, such as
    a lock file, must not have its lines echoed)."""
    names = {dict: "a JSON object", list: "a JSON array", str: "a JSON string", bool: "a JSON boolean",
             int: "a JSON integer", float: "a JSON number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_manifest(path: str | Path) -> list[Sample]:
    """Read a JSON Lines manifest file (lines bounded: :func:`bounded_lines`)."""
    p = Path(path)
    with p.open() as fh:
        return list(parse_manifest_lines(bounded_lines(fh, source=str(p)), source=str(p)))


def write_manifest(samples: Iterable[Sample], path: str | Path) -> None:
    """Write samples as a JSON Lines manifest."""
    with Path(path).open("w") as fh:
        for s in samples:
            fh.write(s.model_dump_json(exclude_none=True) + "\n")
