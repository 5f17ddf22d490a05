"""The compute/memory sweep: token counts x packings x layer counts x checkpoint policies x
group sizes.

``run_sweep`` builds ``max(layer_counts)`` real layers of the profiled shape, then for every
micro-batch of the plan (single samples over a log-spaced range of sizes, plus packed
micro-batches of several samples) and every ``(num_layers, recompute_layers)`` pair times
forward+backward and counts the activation bytes, and finally times the head over a range of
token counts. Records follow ``costmodel.profiling.format``.

Several layer counts separate per-layer costs from per-micro-batch costs; several checkpoint
policies separate forward from backward time (a recomputed layer runs its forward again);
several group sizes (one rank's share, ``blocks.emulated_seq_to_head``) separate what shrinks
with the tokens per rank from what does not (the efficiency of attention on short shards).
Sample sizes are rounded to multiples of every group size so that shards are even.
"""

from __future__ import annotations

import logging
import math
import platform
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from costmodel.profiling.blocks import SampleShape, build_head, build_layers
from costmodel.profiling.format import ComputeRecord, HeadRecord, ProfileHeader
from costmodel.profiling.measure import (
    CpuClock,
    MemoryMeasurement,
    head_activation_bytes,
    head_peak_bytes,
    make_head_step,
    make_step,
    measure_memory,
    time_interleaved,
)
from costmodel.specs import ModelSpec

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
ProgressFn = Callable[[int, int, str], None]
"""Called as ``progress(done, total, description)`` after each measurement."""
LayerFactory = Callable[..., nn.ModuleList]
"""``factory(spec, num_layers, device=..., dtype=...)``: the layers to profile; each is called as
``layer(x, samples, *extras, group_size)`` (``blocks.build_layers`` is the default)."""
HeadFactory = Callable[..., nn.Module]
"""``factory(spec, device=..., dtype=...)``: the head (``blocks.build_head`` is the default)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SweepConfig:
    """What the sweep runs."""

    tokens_min: int = 128
    """Smallest micro-batch in tokens."""
    tokens_max: int = 2048
    """Largest micro-batch in tokens."""
    num_sizes: int = 8
    """Log-spaced single-sample sizes between ``tokens_min`` and ``tokens_max``."""
    packings: tuple[int, ...] = (2, 4)
    """Samples per packed micro-batch (one or more packed micro-batches per entry)."""
    num_packed: int = 3
    """Packed micro-batches per packing."""
    frames: tuple[int, ...] = (1, 2, 4, 8, 16)
    """2D only: frame counts the sample shapes are drawn from."""
    layer_counts: tuple[int, ...] = (1, 2)
    """Stack depths to run (the largest is built)."""
    policies: Literal["all", "ends"] = "all"
    """Checkpointed layers per depth: every k in 0..n, or only 0 and n."""
    num_head_sizes: int = 6
    """Head measurements (log-spaced token counts)."""
    warmup: int = 2
    """Untimed runs before timing."""
    repeats: int = 7
    """Timed runs (the median is recorded)."""
    seed: int = 0
    """Seed of the packings and the weights."""
    cpu_clock: CpuClock = "wall"
    """CPU timer: ``wall`` (perf_counter) or ``thread`` (the thread's CPU time; one torch thread)."""
    group_sizes: tuple[int, ...] = (1, 2, 4)
    """SP group sizes whose one rank's share is measured (1 with every policy and depth, the
    others without checkpointing at the deepest stack)."""

    def __post_init__(self) -> None:
        if not 0 < self.tokens_min <= self.tokens_max:
            raise ValueError(f"need 0 < tokens_min <= tokens_max, got {self.tokens_min}, {self.tokens_max}")
        if self.num_sizes < 2:
            raise ValueError(f"num_sizes must be >= 2, got {self.num_sizes}")
        if any(p < 2 for p in self.packings):
            raise ValueError(f"packings must be >= 2 samples, got {self.packings}")
        if not self.layer_counts or any(n < 1 for n in self.layer_counts):
            raise ValueError(f"layer_counts must be positive, got {self.layer_counts}")
        if any(f < 1 for f in self.frames):
            raise ValueError(f"frames must be positive, got {self.frames}")
        if not self.group_sizes or any(d < 1 for d in self.group_sizes) or 1 not in self.group_sizes:
            raise ValueError(f"group_sizes must be positive and include 1, got {self.group_sizes}")
        if self.cpu_clock not in ("wall", "thread"):
            raise ValueError(f"cpu_clock must be wall or thread, got {self.cpu_clock!r}")
        if self.repeats < 1 or self.warmup < 0 or self.num_head_sizes < 0 or self.num_packed < 0:
            raise ValueError(
                f"need repeats >= 1, warmup >= 0, num_head_sizes >= 0, num_packed >= 0; got "
                f"{self.repeats}, {self.warmup}, {self.num_head_sizes}, {self.num_packed}"
            )


def log_sizes(lo: int, hi: int, num: int) -> list[int]:
    """``num`` log-spaced integers from ``lo`` to ``hi`` (duplicates removed)."""
    if num == 1 or lo == hi:
        return [lo]
    ratio = (hi / lo) ** (1 / (num - 1))
    return sorted({round(lo * ratio**i) for i in range(num)})


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def sample_shapes(spec: ModelSpec, config: SweepConfig) -> list[SampleShape]:
    """Single-sample shapes: 1D ``(1, s)`` per size; 2D two ``(frames, hw)`` per size.

    The 2D frame counts rotate through ``config.frames`` at two offsets, so that frames and
    tokens per frame vary independently (spatial and temporal pairs must not be collinear).
    Tokens (1D) and tokens per frame (2D) are multiples of every group size.
    """
    unit = math.lcm(*config.group_sizes)
    sizes = log_sizes(config.tokens_min, config.tokens_max, config.num_sizes)
    if spec.kind == "1d":
        return sorted({(1, _round_up(s, unit)) for s in sizes})
    shapes: list[SampleShape] = []
    num = len(config.frames)
    for i, total in enumerate(sizes):
        for offset in sorted({0, num // 2}):
            frames = min(config.frames[(i + offset) % num], total)
            shape = (frames, _round_up(max(1, round(total / frames)), unit))
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def micro_batches(spec: ModelSpec, config: SweepConfig) -> list[list[SampleShape]]:
    """Single samples, then packed micro-batches of shapes that fit under ``tokens_max``."""
    singles = sample_shapes(spec, config)
    batches = [[s] for s in singles]
    rng = random.Random(config.seed)
    for num in config.packings:
        made, tries = 0, 0
        while made < config.num_packed and tries < 1000:
            tries += 1
            pick = [rng.choice(singles) for _ in range(num)]
            if sum(f * hw for f, hw in pick) <= config.tokens_max:
                batches.append(pick)
                made += 1
    return batches


Run = tuple[list[SampleShape], int, int, int]
"""``(micro-batch, num_layers, recompute_layers, group_size)``."""


def plan_runs(spec: ModelSpec, config: SweepConfig) -> list[Run]:
    """Every ``(micro-batch, num_layers, recompute_layers, group_size)`` the sweep measures."""
    runs: list[Run] = []
    deepest = max(config.layer_counts)
    for batch in micro_batches(spec, config):
        for n in sorted(set(config.layer_counts)):
            ks = range(n + 1) if config.policies == "all" else sorted({0, n})
            runs.extend((batch, n, k, 1) for k in ks)
        runs.extend((batch, deepest, 0, d) for d in sorted(set(config.group_sizes)) if d > 1)
    return runs


def make_header(*, model: ModelSpec, profiled: ModelSpec, hardware: str, device: torch.device,
                dtype: str, notes: str = "", cpu_clock: CpuClock = "wall") -> ProfileHeader:
    """The header of a compute profile made on this machine."""
    import costmodel

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return ProfileHeader(
        hardware=hardware, device="cuda" if device.type == "cuda" else "cpu", device_name=name or "",
        dtype=dtype,  # type: ignore[arg-type]
        model=model, profiled=profiled, num_threads=torch.get_num_threads(),
        timer="cuda_events" if device.type == "cuda" else
        ("thread_time" if cpu_clock == "thread" else "perf_counter"),
        versions={"python": platform.python_version(), "torch": torch.__version__,
                  "dcp": getattr(costmodel, "__version__", "0")},
        notes=notes,
    )


def _extras(spec: ModelSpec, batch: list[SampleShape], *, device: torch.device, dtype: torch.dtype,
            generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    if spec.kind == "1d":
        return ()
    cond = torch.randn(len(batch), spec.hidden, generator=generator).to(device=device, dtype=dtype)
    text = torch.randn(len(batch), spec.cross_attention_tokens, spec.hidden, generator=generator)
    return cond, text.to(device=device, dtype=dtype)


def run_sweep(profiled: ModelSpec, config: SweepConfig, *, device: torch.device, dtype: str,
              progress: ProgressFn | None = None, layer_factory: LayerFactory | None = None,
              head_factory: HeadFactory | None = None) -> list[ComputeRecord | HeadRecord]:
    """Measure the layers and the head of the ``profiled`` shape; one record per configuration.

    Timing is interleaved (``measure.time_interleaved``): every round runs every configuration
    once, so that a slow period of the machine does not bias a few configurations.

    Args:
        profiled: The shape that runs (fewer layers/narrower than the full model if needed).
        config: The sweep.
        device: Where to run.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        progress: Optional progress callback.
        layer_factory: Builds the layers to profile (default: ``blocks.build_layers``; the
            executor's own layers for ``dcp check-model``).
        head_factory: Builds the head (default: ``blocks.build_head``).

    Raises:
        ValueError: for an unknown dtype or a sweep deeper than ``profiled.num_layers``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if max(config.layer_counts) > profiled.num_layers:
        raise ValueError(
            f"layer_counts={config.layer_counts} exceed profiled.num_layers={profiled.num_layers}"
        )
    bad = [d for d in config.group_sizes if profiled.num_heads % d]
    if bad:
        raise ValueError(f"group_sizes {bad} do not divide the profiled shape's "
                         f"num_heads={profiled.num_heads}")
    torch_dtype = DTYPES[dtype]
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    layers = (layer_factory or build_layers)(profiled, max(config.layer_counts), device=device,
                                             dtype=torch_dtype)
    head = (head_factory or build_head)(profiled, device=device, dtype=torch_dtype)
    runs = plan_runs(profiled, config)
    head_sizes = log_sizes(config.tokens_min, config.tokens_max, config.num_head_sizes) \
        if config.num_head_sizes else []
    steps: list[Callable[[], None]] = []
    memory: list[MemoryMeasurement] = []
    head_inputs: list[torch.Tensor] = []
    for batch, n, k, d in runs:
        tokens = sum(f * hw for f, hw in batch) // d
        x = torch.randn(tokens, profiled.hidden, generator=gen).to(device=device, dtype=torch_dtype)
        x.requires_grad_(True)
        extra = _extras(profiled, batch, device=device, dtype=torch_dtype, generator=gen)
        memory.append(measure_memory(layers[:n], x, batch, recompute_layers=k, extra=extra,
                                     group_size=d))
        steps.append(make_step(layers[:n], x, batch, recompute_layers=k, extra=extra, group_size=d))
    for tokens in head_sizes:
        if profiled.kind == "1d":
            inputs = torch.randint(0, profiled.vocab, (tokens,), generator=gen).to(device)
        else:
            inputs = torch.randn(tokens, 16, generator=gen).to(device=device, dtype=torch_dtype)
        head_inputs.append(inputs)
        steps.append(make_head_step(head, inputs))

    def tick(done: int, total: int) -> None:
        if progress is not None:
            progress(done, total, f"{profiled.name}: round {1 + (done - 1) * config.repeats // total}"
                                  f"/{config.repeats}")

    timings = time_interleaved(steps, device=device, warmup=config.warmup, repeats=config.repeats,
                               progress=tick, clock=config.cpu_clock)
    records: list[ComputeRecord | HeadRecord] = []
    for (batch, n, k, d), mem, t in zip(runs, memory, timings, strict=False):
        records.append(ComputeRecord(
            num_layers=n, recompute_layers=k, samples=batch, group_size=d,
            tokens_per_rank=sum(f * hw for f, hw in batch) // d, time_s=t.time_s,
            time_s_min=t.time_s_min, time_s_max=t.time_s_max, num_repeats=t.num_repeats,
            activation_bytes=float(mem.activation_bytes), device_kept_bytes=mem.device_kept_bytes,
            device_peak_bytes=mem.device_peak_bytes,
        ))
    for tokens, inputs, t in zip(head_sizes, head_inputs, timings[len(runs):], strict=True):
        records.append(HeadRecord(
            tokens=tokens, time_s=t.time_s, time_s_min=t.time_s_min, time_s_max=t.time_s_max,
            num_repeats=t.num_repeats, activation_bytes=float(head_activation_bytes(head, inputs)),
            device_peak_bytes=head_peak_bytes(head, inputs),
        ))
    logger.info("sweep of %s: %d configurations on %s", profiled.name, len(steps), device)
    return records
