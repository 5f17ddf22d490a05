"""Count what any stack of ``nn.Module`` blocks keeps for backward, per checkpoint policy and tokens.

The Python entry point is :func:`profile_module`: give it a factory of blocks (``factory(index)``
returns a new block), a function making one sample's inputs and how to call a block (as
:class:`costmodel.profiling.real_classes.RealBlocks` does for the models' own classes), and it
measures a stack of ``num_layers`` blocks under every policy ``k`` (the first ``k`` blocks
checkpointed, ``torch.utils.checkpoint`` non-reentrant) at every token count:

* ``saved_bytes``: exact and device independent: the unique storages autograd saves for
  backward (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once by its data
  pointer, so views and tensors saved by several operations count once), plus the inputs a
  checkpointed block holds; parameters and the inputs shared by every block (rotary tables,
  text states, timestep embedding) are not counted;
* ``kept_bytes``, ``forward_peak_bytes``, ``peak_bytes``: live bytes above the start after the
  forward (the output excluded), at the forward's peak and at the peak of forward+backward (on
  a CPU the storages live in the block, :class:`costmodel.profiling.memtrack.LiveBytesTracker`;
  on a GPU ``torch.cuda.memory_allocated`` / ``max_memory_allocated``); ``transient_bytes`` is
  ``peak_bytes - kept_bytes``, the working set of the backward above what the forward kept;
* ``cuda_max_allocated_bytes``: on a GPU only, ``torch.cuda.max_memory_allocated`` over
  forward+backward above the start;
* ``time_s``: forward+backward, the median of ``repeats`` runs after ``warmup``
  (:func:`costmodel.profiling.measure.time_runs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from costmodel.profiling.measure import SavedBytesCounter, time_runs
from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.profiling.real_classes import BlockInputs

BlockCall = Callable[[nn.Module, tuple[torch.Tensor, ...], tuple[Any, ...]], tuple[torch.Tensor, ...]]
"""``call(block, state, context)``: a block's forward on the state; the new state."""


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make new floating-point tensors (a block's weights) in ``dtype`` inside the block."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def stack_forward(blocks: Sequence[nn.Module], inputs: BlockInputs, call: BlockCall, *, recompute_layers: int,
                  counter: SavedBytesCounter | None = None) -> tuple[torch.Tensor, ...]:
    """The blocks' forward on one sample, the first ``recompute_layers`` checkpointed.

    Raises:
        ValueError: for ``recompute_layers`` outside ``[0, len(blocks)]``.
    """
    if not 0 <= recompute_layers <= len(blocks):
        raise ValueError(f"recompute_layers={recompute_layers} not in [0, {len(blocks)}]")
    state = inputs.state
    for index, block in enumerate(blocks):
        if index < recompute_layers:
            if counter is not None:
                for t in state:
                    counter.add(t)

            def run(*st: torch.Tensor, block: nn.Module = block) -> tuple[torch.Tensor, ...]:
                return call(block, st, inputs.context)

            state = checkpoint(run, *state, use_reentrant=False)
        elif counter is not None:
            with counter.recording():
                state = call(block, state, inputs.context)
        else:
            state = call(block, state, inputs.context)
    return tuple(state)


def saved_bytes(blocks: Sequence[nn.Module], inputs: BlockInputs, call: BlockCall, *, recompute_layers: int) -> int:
    """Exact bytes the stack's forward keeps for backward (see the module docstring)."""
    params = [p for b in blocks for p in b.parameters()]
    counter = SavedBytesCounter([*params, *_tensors(inputs.context)])
    out = stack_forward(blocks, inputs, call, recompute_layers=recompute_layers, counter=counter)
    del out
    return counter.num_bytes


@dataclass(kw_only=True, frozen=True, slots=True)
class StackMeasurement:
    """One stack, policy and token count."""

    block: str
    """The block class measured."""
    num_layers: int
    """Blocks in the stack."""
    recompute_layers: int
    """Checkpointed blocks (the first ones)."""
    tokens: int
    """Tokens of the sample."""
    saved_bytes: int
    """Exact bytes kept for backward (unique storages, parameters and shared inputs excluded)."""
    kept_bytes: float
    """Live bytes after the forward above the start, the output excluded."""
    forward_peak_bytes: float
    """Peak live bytes of the forward above the start."""
    peak_bytes: float
    """Peak live bytes of forward+backward above the start (parameter gradients preallocated)."""
    transient_bytes: float
    """``peak_bytes - kept_bytes``: what the backward needs above what the forward kept."""
    cuda_max_allocated_bytes: float | None
    """GPU only: ``torch.cuda.max_memory_allocated`` over forward+backward above the start."""
    time_s: float
    """Median forward+backward seconds (0 when not timed)."""


def _backward(outs: tuple[torch.Tensor, ...]) -> None:
    torch.autograd.backward([o for o in outs if o.requires_grad],
                            [torch.ones_like(o) for o in outs if o.requires_grad])


def measure_stack(blocks: Sequence[nn.Module], inputs: BlockInputs, call: BlockCall, *, recompute_layers: int,
                  block: str = "", warmup: int = 1, repeats: int = 3) -> StackMeasurement:
    """Saved bytes, live bytes and time of one forward+backward of the stack (``repeats=0``: untimed)."""
    device = inputs.state[0].device
    params = [p for b in blocks for p in b.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    count = saved_bytes(blocks, inputs, call, recompute_layers=recompute_layers)
    cuda_peak: float | None = None
    if device.type == "cuda":  # GPU only: the allocator's counters
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        outs = stack_forward(blocks, inputs, call, recompute_layers=recompute_layers)
        kept = float(torch.cuda.memory_allocated(device) - base - sum(o.untyped_storage().nbytes() for o in outs))
        forward_peak = float(torch.cuda.max_memory_allocated(device) - base)
        _backward(outs)
        torch.cuda.synchronize(device)
        peak = cuda_peak = float(torch.cuda.max_memory_allocated(device) - base)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        with LiveBytesTracker(exclude=[*params, *grads, *inputs.state,
                                       *_tensors(inputs.context)]) as tracker:
            outs = stack_forward(blocks, inputs, call, recompute_layers=recompute_layers)
            kept = float(tracker.current_bytes - sum(o.untyped_storage().nbytes() for o in outs))
            forward_peak = float(tracker.peak_bytes)
            _backward(outs)
            peak = float(tracker.peak_bytes)
    del outs
    for t in inputs.state:
        t.grad = None

    def step() -> None:
        _backward(stack_forward(blocks, inputs, call, recompute_layers=recompute_layers))
        for t in inputs.state:
            t.grad = None

    time_s = time_runs(step, device=device, warmup=warmup, repeats=repeats).time_s if repeats else 0.0
    for p in params:
        p.grad = None
    return StackMeasurement(block=block, num_layers=len(blocks), recompute_layers=recompute_layers,
                            tokens=inputs.tokens, saved_bytes=count, kept_bytes=kept,
                            forward_peak_bytes=forward_peak, peak_bytes=peak, transient_bytes=peak - kept,
                            cuda_max_allocated_bytes=cuda_peak, time_s=time_s)


def profile_module(factory: Callable[[int], nn.Module], make_inputs: Callable[..., BlockInputs], call: BlockCall,
                   *, tokens: Sequence[int], num_layers: int = 2, policies: Sequence[int] | None = None,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   warmup: int = 1, repeats: int = 3, block: str = "") -> list[StackMeasurement]:
    """Measure a stack of ``num_layers`` blocks from ``factory`` per policy and token count.

    Args:
        factory: ``factory(index)`` -> a new block (random weights).
        make_inputs: ``make_inputs(tokens, device=..., dtype=..., generator=...)`` -> one sample's inputs.
        call: ``call(block, state, context)`` -> the new state.
        tokens: Token counts of the sample.
        num_layers: Blocks in the stack.
        policies: Checkpointed blocks per run (default every ``k`` in ``0..num_layers``).
        device: Where to run.
        dtype: The blocks' dtype (the models train in bfloat16).
        seed: Seed of the weights and inputs.
        warmup: Untimed runs before timing.
        repeats: Timed runs (0: not timed, ``time_s`` 0).
        block: Name of the block in the records.

    Raises:
        ValueError: for no token counts, a token count or ``num_layers`` below 1, or a policy
            outside ``[0, num_layers]``.
    """
    if not tokens or min(tokens) < 1 or num_layers < 1:
        raise ValueError(f"need token counts >= 1 and num_layers >= 1, got tokens={list(tokens)}, "
                         f"num_layers={num_layers}")
    ks = list(range(num_layers + 1)) if policies is None else list(policies)
    bad = [k for k in ks if not 0 <= k <= num_layers]
    if bad:
        raise ValueError(f"policies {bad} are outside [0, num_layers={num_layers}]")
    torch_device = torch.device(device)
    torch.manual_seed(seed)
    with default_dtype(dtype):
        blocks = [factory(i).to(device=torch_device, dtype=dtype) for i in range(num_layers)]
    generator = torch.Generator().manual_seed(seed)
    rows: list[StackMeasurement] = []
    for s in tokens:
        inputs = make_inputs(s, device=torch_device, dtype=dtype, generator=generator)
        rows.extend(measure_stack(blocks, inputs, call, recompute_layers=k, block=block, warmup=warmup,
                                  repeats=repeats) for k in ks)
    return rows
