"""Python's cyclic garbage collector paused while one batch is planned.

Planning 8,192 samples allocates hundreds of thousands of small objects (the search's lists,
the plan's pydantic models); each time the allocation counters cross their thresholds the
collector walks the young objects, and every so often all live ones, the service's stored
plans and caches included. On text-longtail 1,024 GPUs x 8,192 samples that was a fifth of the
plan (0.77x the CPU time with the collector paused, interleaved A/B in
``bench/plan_latency.py``; the assembly and the intra pass were three times slower with it
on). The plans are the same (nothing in the search depends on collection), and a plan leaves
no cyclic garbage to wait for the collector (``gc.collect()`` right after a 1,024 x 8,192 plan
finds 0 unreachable objects): what it allocates is freed by reference counting as it goes.

The pause is process-wide. Only the call that switched the collector off switches it back on, so
nested or concurrent plans (service threads) never leave it off, and a caller that disabled the
collector itself finds it still disabled.

The collector's allocation counter keeps counting while it is off, so the first allocation after
it is back on used to start a collection of the youngest generation: every object the plan
allocated and kept (the whole plan, which the caller is about to use), walked only to find it
alive, 0.21 s of a 16,384 x 131,072 plan. Before switching it back on, the pause moves every
tracked object to the oldest generation instead (``gc.freeze()`` then ``gc.unfreeze()``, which
also resets the young generation's count), where only the full collections, which walk every
object anyway, look at them; a plan is freed by reference counting, not by the collector. That is
skipped when the process has frozen objects of its own (``gc.get_freeze_count()``), which
``gc.unfreeze()`` would release.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Switch the cyclic collector off for the ``with`` block (back on after it, if this call
    switched it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:  # nothing of the caller's to release by unfreezing
                gc.freeze()  # what the block kept goes to the oldest generation, uncollected
                gc.unfreeze()
            gc.enable()
