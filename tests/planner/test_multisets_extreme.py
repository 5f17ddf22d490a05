"""Rounding fractional group counts stays within the world whatever the counts (found by the
service fuzzer: an uploaded cost model made a deadline-scaled count of ~1e300 groups, whose
integer cast wrapped negative and asked ``fill_ranks`` for 2^63 ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from planner.placement import fill_ranks
from planner.search.multisets import _round_groups


@pytest.mark.parametrize("groups", [[1e300, 0.5, 0.0], [np.inf, np.nan, 2.0], [-5.0, 3.0, 1e30]])
@pytest.mark.parametrize("ceil_largest", [True, False])
def test_round_groups_of_extreme_counts_fill_the_world(groups: list[float], ceil_largest: bool) -> None:
    sizes, n = [4, 2, 1], 8
    multiset = _round_groups(np.array(groups), sizes, n, ceil_largest=ceil_largest)
    assert multiset is not None
    assert sum(multiset) == n and all(d in sizes for d in multiset)


def test_fill_ranks_of_a_negative_count_is_none() -> None:
    assert fill_ranks(-3, [2, 1]) is None
    assert sorted(fill_ranks(5, [2, 1]) or [], reverse=True) == [2, 2, 1]


def test_a_cost_model_whose_times_overflow_is_refused_by_name() -> None:
    """The fuzzer's second find: an uploaded file with per-call and fixed costs near 1e308 made
    every time infinite and the heuristic found no group multiset (an assertion, a 500)."""
    from costmodel.presets import default_cost_model_file, load_cluster
    from costmodel.specs import Sample
    from planner.planning import plan_batch

    cluster = load_cluster("h200x8")
    base = default_cost_model_file("llama-7b", cluster.hardware.name)
    huge = base.model_copy(update={"id": "huge", "compute": base.compute.model_copy(update={
        "forward": base.compute.forward.model_copy(update={"per_call": 4.36e307}),
        "microbatch_overhead_s": 2.4e307})})
    samples = [Sample(id=f"doc-{i}", tokens=1000 + 500 * i) for i in range(3)]
    with pytest.raises(ValueError, match="'huge' predicts a non-finite"):
        plan_batch(samples, cluster=cluster, cost_model=huge)
    assert plan_batch(samples, cluster=cluster, cost_model=base).sample_ids  # the sane file plans
