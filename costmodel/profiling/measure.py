"""Measure one micro-batch: forward+backward time and exact activation bytes.

Time: ``warmup`` untimed runs, then ``repeats`` timed runs; CUDA events on a GPU,
``time.perf_counter`` on the CPU (``clock="wall"``) or, on a shared CPU, the calling thread's CPU
time (``clock="thread"``, ``time.thread_time``: with one torch thread, forward and backward both
run on the calling thread, and time the scheduler gives to other processes is not counted). The
median is the measurement, min and max its spread.

Activation bytes (device independent): while the forward runs, a ``saved_tensors_hooks`` pair
records the storage of every tensor autograd saves for backward; checkpointed layers save nothing
inside (``torch.utils.checkpoint`` with ``use_reentrant=False`` installs its own hooks) but hold
their input, which is recorded instead. Unique storages are counted once; parameters and
constant inputs (conditioning, text tokens) are excluded. On a GPU the allocator's view is
recorded too (kept after forward, peak over forward+backward).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from costmodel.profiling.blocks import SampleShape
from costmodel.profiling.memtrack import LiveBytesTracker


@dataclass(kw_only=True, frozen=True, slots=True)
class Timing:
    """Median and spread of repeated runs."""

    time_s: float
    """Median seconds."""
    time_s_min: float
    """Fastest run."""
    time_s_max: float
    """Slowest run."""
    num_repeats: int
    """Timed runs."""

    def __post_init__(self) -> None:
        if self.num_repeats <= 0:
            raise ValueError(f"num_repeats must be positive, got {self.num_repeats}")


CpuClock = Literal["wall", "thread"]


def time_runs(fn: Callable[[], object], *, device: torch.device, warmup: int, repeats: int,
              clock: CpuClock = "wall") -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then time ``repeats`` runs.

    Raises:
        ValueError: when ``repeats`` < 1 or ``warmup`` < 0, or for the thread clock with more
            than one torch thread (the other threads' work would not be counted).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        if clock == "thread" and torch.get_num_threads() != 1:
            raise ValueError(f"clock='thread' needs torch.set_num_threads(1), got {torch.get_num_threads()}")
        now = time.thread_time if clock == "thread" else time.perf_counter
        for _ in range(repeats):
            t0 = now()
            fn()
            times.append(now() - t0)
    return Timing(time_s=statistics.median(times), time_s_min=min(times), time_s_max=max(times),
                  num_repeats=repeats)



def time_interleaved(steps: Sequence[Callable[[], object]], *, device: torch.device, warmup: int,
                     repeats: int, progress: Callable[[int, int], None] | None = None,
                     clock: CpuClock = "wall") -> list[Timing]:
    """Time many steps in rounds: every round runs each step once, in order.

    Interleaving spreads slow periods of a shared machine over all steps instead of letting them
    hit a few; each step still gets ``warmup`` untimed runs first and ``repeats`` timed runs.

    Raises:
        ValueError: when ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for step in steps:
        for _ in range(warmup):
            step()
    times: list[list[float]] = [[] for _ in steps]
    total, done = len(steps) * repeats, 0
    for _ in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(time_runs(step, device=device, warmup=0, repeats=1, clock=clock).time_s)
            done += 1
            if progress is not None:
                progress(done, total)
    return [Timing(time_s=statistics.median(t), time_s_min=min(t), time_s_max=max(t), num_repeats=repeats)
            for t in times]

class SavedBytesCounter:
    """Unique storages saved for backward (see the module docstring)."""

    def __init__(self, exclude: Sequence[torch.Tensor]) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._storages: dict[int, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        """Record a tensor's storage as kept."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._exclude:
            self._storages[ptr] = storage.nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record everything autograd saves inside the block."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    @property
    def num_bytes(self) -> int:
        """Total bytes of the unique storages recorded."""
        return sum(self._storages.values())


def forward_stack(layers: nn.ModuleList, x: torch.Tensor, samples: Sequence[SampleShape], *,
                  recompute_layers: int, extra: Sequence[torch.Tensor] = (),
                  counter: SavedBytesCounter | None = None, group_size: int = 1) -> torch.Tensor:
    """Run the layers as one rank of a group of ``group_size``; the first ``recompute_layers``
    under non-reentrant checkpointing."""
    if not 0 <= recompute_layers <= len(layers):
        raise ValueError(f"recompute_layers={recompute_layers} not in [0, {len(layers)}]")
    for i, layer in enumerate(layers):
        if i < recompute_layers:
            if counter is not None:
                counter.add(x)
            x = checkpoint(layer, x, samples, *extra, group_size, use_reentrant=False)
        elif counter is not None:
            with counter.recording():
                x = layer(x, samples, *extra, group_size)
        else:
            x = layer(x, samples, *extra, group_size)
    return x


@dataclass(kw_only=True, frozen=True, slots=True)
class MemoryMeasurement:
    """Activation memory of one micro-batch configuration."""

    activation_bytes: int
    """Exact bytes kept by the forward for backward."""
    device_kept_bytes: float
    """Bytes live after forward above the start, the output excluded (the allocator on a GPU,
    live tensors on a CPU)."""
    device_peak_bytes: float
    """Peak over forward+backward above the start, the gradient of the output included."""


def make_step(layers: nn.ModuleList, x: torch.Tensor, samples: Sequence[SampleShape], *,
              recompute_layers: int, extra: Sequence[torch.Tensor] = (), group_size: int = 1
              ) -> Callable[[], None]:
    """A forward+backward of the stack on a packed micro-batch (gradients reset first)."""
    params = list(layers.parameters())
    grad_out = torch.randn_like(x)

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        out = forward_stack(layers, x, samples, recompute_layers=recompute_layers, extra=extra,
                            group_size=group_size)
        out.backward(grad_out)

    return step


def measure_memory(layers: nn.ModuleList, x: torch.Tensor, samples: Sequence[SampleShape], *,
                   recompute_layers: int, extra: Sequence[torch.Tensor] = (), group_size: int = 1
                   ) -> MemoryMeasurement:
    """Exact activation bytes of the stack's forward, and live bytes after forward and at the
    peak of forward+backward (the allocator on a GPU; :class:`LiveBytesTracker` on a CPU).

    Parameter gradients exist before the run (zeros), as they do in training after the first
    micro-batch, so the peak is the micro-batch's working memory, not the gradients' storage.
    """
    device = x.device
    params = list(layers.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    counter = SavedBytesCounter([*params, *extra])
    grad_out = torch.ones_like(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = forward_stack(layers, x, samples, recompute_layers=recompute_layers, extra=extra,
                            counter=counter, group_size=group_size)
        kept = float(torch.cuda.memory_allocated(device) - base - out.untyped_storage().nbytes())
        out.backward(grad_out)
        torch.cuda.synchronize(device)
        peak = float(torch.cuda.max_memory_allocated(device) - base)
    else:
        with LiveBytesTracker() as tracker:
            out = forward_stack(layers, x, samples, recompute_layers=recompute_layers, extra=extra,
                                counter=counter, group_size=group_size)
            kept = float(tracker.current_bytes - out.untyped_storage().nbytes())
            out.backward(grad_out)
            peak = float(tracker.peak_bytes)
    del out
    for p in params:
        p.grad = None
    x.grad = None
    return MemoryMeasurement(activation_bytes=counter.num_bytes, device_kept_bytes=kept,
                             device_peak_bytes=peak)


def make_head_step(head: nn.Module, inputs: torch.Tensor) -> Callable[[], None]:
    """A forward+backward of the head, loss included."""
    params = list(head.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        head(inputs).backward()

    return step


def head_activation_bytes(head: nn.Module, inputs: torch.Tensor) -> int:
    """Exact bytes the head's forward keeps for backward."""
    counter = SavedBytesCounter([*head.parameters(), inputs])
    with counter.recording():
        loss = head(inputs)
    del loss
    return counter.num_bytes


def head_peak_bytes(head: nn.Module, inputs: torch.Tensor) -> float:
    """Peak bytes of the head's forward+backward above the start (parameter gradients already
    allocated, as in training): its saved tensors plus its transient working set."""
    params = list(head.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
            torch.cuda.reset_peak_memory_stats(inputs.device)
            base = torch.cuda.memory_allocated(inputs.device)
            head(inputs).backward()
            torch.cuda.synchronize(inputs.device)
            return float(torch.cuda.max_memory_allocated(inputs.device) - base)
        with LiveBytesTracker() as tracker:
            head(inputs).backward()
            return float(tracker.peak_bytes)
    finally:
        for p in params:
            p.grad = None
