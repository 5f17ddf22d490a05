"""The layout-aware lower bounds hold against exhaustive search on tiny instances with rings.

Under ``layout="auto"`` a size column's costs are those of one layout, and a ring's exposed
transfer is per micro-batch, not per sample; the bounds read a view of the table with, per class
and size, the least time over every layout and only the ring's additive parts
(``CostTable.for_bounds``), and the partition LP the least over layouts of its inputs
(``planner.bounds.lp``). Here every bound the planner computes for a batch (the LP and its MIP
too, and the pattern bound), and the bound its plan reports, is compared with the optimum over
every plan whose groups run any Ulysses x ring layout the heads allow
(``tests/planner/bruteforce_rings.py``, which prices micro-batches with the cost model alone): no
bound may exceed it, and the planner's own plan may not beat it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.evaluate import CostModel
from planner.bounds.lp import partition_lp_bound
from planner.bounds.patterns import pattern_bound
from planner.config import PlannerConfig
from planner.planning import plan_batch, prepare
from tests.planner.bruteforce_rings import optimum_with_rings_s
from tests.planner.tiny import samples_of, tiny_cluster, tiny_cost_model

REL = 1e-9


def _ring_degrees(cm: CostModel) -> dict[int, list[int]]:
    """Every ``(size, r)`` of a power-of-two size whose Ulysses degree ``size / r`` the heads allow
    (a superset of what ``layout="auto"`` offers: a bound under the optimum over more plans holds)."""
    n = cm.cluster.num_gpus
    heads_ok = set(cm.file.model.allowed_group_sizes(max_size=n))
    sizes = [d for d in range(1, n + 1) if d & (d - 1) == 0]
    return {d: [r for r in range(1, d + 1) if d % r == 0 and d // r in heads_ok] for d in sizes}


instances = st.tuples(
    st.sampled_from([2, 4]),  # query heads (2: groups of 4 run only with a ring)
    st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 4)]),  # (ranks, ranks per node)
    st.lists(st.integers(min_value=8, max_value=9000), min_size=2, max_size=4),  # tokens per sample
)


@pytest.mark.timeout(300)
@settings(max_examples=14, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_layout_aware_bounds_never_exceed_the_optimum(instance: tuple[int, tuple[int, int], list[int]]) -> None:
    heads, (num_gpus, per_node), tokens = instance
    cluster = tiny_cluster(num_gpus=num_gpus, gpus_per_node=per_node)
    cmf = tiny_cost_model(num_heads=heads, num_layers=2)
    cm = CostModel(file=cmf, cluster=cluster)
    samples = samples_of(tokens)
    best = optimum_with_rings_s(samples, cm, _ring_degrees(cm))
    config = PlannerConfig(layout="auto", memory_safety_fraction=0.0, exact_max_samples=4, exact_max_ranks=4,
                           exact_time_limit_s=20.0, lp_bound_iterations=10, lp_bound_min_gap=0.0,
                           lp_bound_integral=True, lp_bound_micro_batch_buckets=3)
    try:
        prep = prepare(samples, cluster=cluster, cost_model=cmf, config=config)
    except ValueError:
        assert best == math.inf  # a sample fits no group under any layout
        return
    report = prep.bounds
    for kind, value in [("longest", report.longest_s), ("area", report.area_s),
                        ("deadline-area", report.deadline_area_s), ("largest-choice", report.largest_choice_s)]:
        assert value <= best * (1 + REL), (kind, value, best)
    view = prep.table.for_bounds()
    for integral, buckets in ((False, 1), (True, 3)):  # the partition LP (and MIP) on the bounds' view
        lp = partition_lp_bound(view, lower_s=report.compute_makespan_s, iterations=10, integral_groups=integral,
                                micro_batch_buckets=buckets) + prep.table.grad_sync_s
        assert lp <= best * (1 + REL), ("partition-lp", integral, lp, best)
    patterns = pattern_bound(view, lower_s=report.compute_makespan_s, iterations=10) + prep.table.grad_sync_s
    assert patterns <= best * (1 + REL), ("patterns", patterns, best)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config)
    assert plan.lower_bound.value_s <= best * (1 + REL), (plan.lower_bound, best)
    assert best <= plan.predicted_step_time_s * (1 + REL)  # the enumeration misses no plan


def test_the_enumeration_needs_a_ring_where_the_heads_stop() -> None:
    """With 2 heads on 4 ranks, a sample of 8,000 tokens fits only a group of 4 ranks (by the cost
    model's bytes), which only a ring runs: the enumeration finds a plan with rings and none
    without; a second sample costs more on top."""
    cluster = tiny_cluster(num_gpus=4, gpus_per_node=2)
    cm = CostModel(file=tiny_cost_model(num_heads=2, num_layers=2), cluster=cluster)
    degrees = _ring_degrees(cm)
    assert degrees == {1: [1], 2: [1, 2], 4: [2, 4]}
    alone = optimum_with_rings_s(samples_of([8000]), cm, degrees)
    assert math.isfinite(alone)
    assert optimum_with_rings_s(samples_of([8000]), cm, {1: [1], 2: [1, 2]}) == math.inf
    assert optimum_with_rings_s(samples_of([8000, 60]), cm, degrees) > alone
