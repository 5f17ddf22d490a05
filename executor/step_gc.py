"""Python's garbage collector at step boundaries, not whenever its allocation counters say.

With the default thresholds a full (generation 2) collection starts in the middle of whichever
micro-batch happens to allocate past the threshold, on one rank and not the others: the other
ranks wait for it at the next collective, and a measured micro-batch (``executor.measure``)
takes it as compute. On the CPU recalibration benchmark (``bench/recalibration.py``, 2 gloo
ranks, 30-90 ms micro-batches) 7 of 8 runs had one or two micro-batches 3.5-4.8x their
prediction after step 20, two of them with the service on ``SCHED_IDLE`` (so not the solver
pool stealing the core); with collections moved to step boundaries, none in 5 runs (the worst
1.43x). Megatron-LM's ``--manual-gc`` does the same for the same reason (aligned collections,
no CPU jitter).

Use::

    step_gc = StepGC(every_steps=1)  # disables the automatic collector now
    executor = Executor(registry=registry, step_gc=step_gc)
    ...  # every executor.begin_step collects first, every `every_steps`-th step
    step_gc.close()  # the automatic collector back as it was

Reference counting still frees acyclic garbage at once; only cycles wait for the boundary.
"""

from __future__ import annotations

import gc
import logging
import time
from types import TracebackType

logger = logging.getLogger(__name__)


class StepGC:
    """Full collections every ``every_steps`` steps at the step boundary, none in between."""

    def __init__(self, *, every_steps: int = 1) -> None:
        """Collect once and switch the automatic collector off (process-wide).

        Args:
            every_steps: Steps between collections (1: before every step).

        Raises:
            ValueError: if ``every_steps`` is below 1.
        """
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be a positive integer, got {every_steps!r}")
        self.every_steps = every_steps
        self._was_enabled = gc.isenabled()
        self._boundaries = 0
        self.num_collections = 0
        """Collections run at step boundaries so far."""
        self.collect_s = 0.0
        """Seconds spent in them."""
        self._closed = False
        gc.collect()
        gc.disable()

    def at_step_boundary(self) -> None:
        """Called before each step's work (``Executor.begin_step``): collect on every
        ``every_steps``-th call."""
        if self._closed:
            return
        self._boundaries += 1
        if self._boundaries % self.every_steps:
            return
        start = time.perf_counter()
        found = gc.collect()
        elapsed_s = time.perf_counter() - start
        self.num_collections += 1
        self.collect_s += elapsed_s
        logger.debug("step-boundary collection: %d objects in %.1f ms", found, elapsed_s * 1e3)

    def close(self) -> None:
        """Give the automatic collector back (enabled if it was when this started)."""
        if self._closed:
            return
        self._closed = True
        if self._was_enabled:
            gc.enable()

    def __enter__(self) -> StepGC:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
