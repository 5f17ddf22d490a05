"""Global batch rules and step seeds of the epoch precompute (planner/epoch.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.specs import Sample
from planner.epoch import BatchRule, make_steps, step_seed


def _samples(lengths: list[int]) -> list[Sample]:
    return [Sample(id=f"x{i}", tokens=t) for i, t in enumerate(lengths)]


@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=200),
       per_step=st.integers(1, 40), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_samples_rule_partitions_manifest(lengths: list[int], per_step: int, seed: int) -> None:
    samples = _samples(lengths)
    steps = make_steps(samples, rule=BatchRule(samples_per_step=per_step), seed=seed)
    ids = [s.id for step in steps for s in step]
    assert sorted(ids) == sorted(s.id for s in samples)  # each sample exactly once
    assert all(len(step) == per_step for step in steps[:-1])
    assert 1 <= len(steps[-1]) <= per_step
    assert steps == make_steps(samples, rule=BatchRule(samples_per_step=per_step), seed=seed)


@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=200),
       budget=st.integers(5000, 20000), seed=st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_tokens_rule_respects_budget(lengths: list[int], budget: int, seed: int) -> None:
    samples = _samples(lengths)
    steps = make_steps(samples, rule=BatchRule(tokens_per_step=budget), seed=seed)
    assert sorted(s.id for step in steps for s in step) == sorted(s.id for s in samples)
    for i, step in enumerate(steps):
        assert sum(s.tokens for s in step) <= budget
        if i + 1 < len(steps):  # a step closes only when the next sample would not fit
            assert sum(s.tokens for s in step) + steps[i + 1][0].tokens > budget


def test_seed_changes_order_not_membership() -> None:
    samples = _samples(list(range(1, 101)))
    a = make_steps(samples, rule=BatchRule(samples_per_step=10), seed=1)
    b = make_steps(samples, rule=BatchRule(samples_per_step=10), seed=2)
    assert a != b
    assert sorted(s.id for st_ in a for s in st_) == sorted(s.id for st_ in b for s in st_)


def test_oversize_sample_is_named() -> None:
    samples = _samples([100, 99999, 100])
    with pytest.raises(ValueError, match="'x1' has 99999 tokens"):
        make_steps(samples, rule=BatchRule(tokens_per_step=1000), seed=0)


def test_bad_rules() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        BatchRule()
    with pytest.raises(ValueError, match="exactly one"):
        BatchRule(samples_per_step=4, tokens_per_step=100)
    with pytest.raises(ValueError, match="samples_per_step must be positive, got 0"):
        BatchRule(samples_per_step=0)
    with pytest.raises(ValueError, match="no samples"):
        make_steps([], rule=BatchRule(samples_per_step=4), seed=0)


def test_step_seed_is_stable_and_distinct() -> None:
    assert step_seed(3, 7) == step_seed(3, 7)
    seeds = {step_seed(3, s) for s in range(1000)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**31 for s in seeds)
    assert step_seed(4, 7) != step_seed(3, 7)
