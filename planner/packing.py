"""First-fit packing of items into bins of one capacity (micro-batches under the memory cap).

The planner packs first-fit in several places (the baselines' ``first_fit``, the inter-only
layout ``search.intra.kmin_layout``, the local search's ``repack``); all place each item, in
the order given, into the first bin with room for it, else into a new bin. A plain scan visits
every bin per item; here bins that no remaining item can fit any more (free bytes below the
smallest remaining item) are dropped from the scan, which gives the same bins, in the same
order, with the same free bytes (the same subtractions), at a fraction of the visits when most
bins are full (first-fit decreasing leaves most of them so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def first_fit_bins(mems: Sequence[float], capacity: float) -> tuple[list[list[int]], list[float]]:
    """First-fit packing of items with sizes ``mems`` (in the order given).

    Args:
        mems: Item sizes (bytes), in placement order.
        capacity: Capacity of every bin.

    Returns:
        ``(bins, free)``: the positions (indices into ``mems``) in each bin in placement order,
        and each bin's free capacity after packing (``capacity`` minus its items, subtracted
        one at a time in placement order).
    """
    n = len(mems)
    # floor[t]: the smallest of mems[t:] (NaN sizes ignored: they fit no bin).
    floor = [math.inf] * (n + 1)
    for t in range(n - 1, -1, -1):
        m = mems[t]
        floor[t] = m if m < floor[t + 1] else floor[t + 1]
    bins: list[list[int]] = []
    free: list[float] = []
    live: list[int] = []  # bins some remaining item may still fit, in bin order
    for t in range(n):
        m = mems[t]
        idx = 0
        while idx < len(live):
            pos = live[idx]
            f = free[pos]
            if f >= m:
                f -= m
                free[pos] = f
                bins[pos].append(t)
                if f < floor[t + 1]:
                    del live[idx]
                break
            if f < floor[t]:
                del live[idx]  # no item from t on fits it
            else:
                idx += 1
        else:
            bins.append([t])
            f = capacity - m
            free.append(f)
            if f >= floor[t + 1]:
                live.append(len(free) - 1)
    return bins, free
