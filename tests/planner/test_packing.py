"""``planner.packing.first_fit_bins`` against a plain first-fit scan of every bin."""

from __future__ import annotations

import random

import pytest

from planner.packing import first_fit_bins


def _plain_first_fit(mems: list[float], capacity: float) -> tuple[list[list[int]], list[float]]:
    bins: list[list[int]] = []
    free: list[float] = []
    for t, m in enumerate(mems):
        for pos, f in enumerate(free):
            if f >= m:
                bins[pos].append(t)
                free[pos] -= m
                break
        else:
            bins.append([t])
            free.append(capacity - m)
    return bins, free


@pytest.mark.parametrize("seed", range(40))
def test_same_bins_and_free_bytes_as_a_plain_scan(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([1.0, 7.3, 100.0])
    n = rng.randint(0, 120)
    mems = [capacity * rng.choice([rng.random(), rng.random() ** 3, 0.5, 1 / 3, 1.2])
            for _ in range(n)]
    if seed % 2:
        mems.sort(reverse=True)  # first-fit decreasing, as the planner packs
    assert first_fit_bins(mems, capacity) == _plain_first_fit(mems, capacity)


def test_nan_and_oversized_items() -> None:
    mems = [5.0, float("nan"), 1.0, 12.0, 3.0, float("inf"), 1.0]
    assert repr(first_fit_bins(mems, 10.0)) == repr(_plain_first_fit(mems, 10.0))  # nan != nan
    assert first_fit_bins([], 10.0) == ([], [])
