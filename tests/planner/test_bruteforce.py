"""The solver is optimal on tiny instances: CP-SAT's plan equals the exhaustive optimum."""

from __future__ import annotations

import math
import random

import pytest

from costmodel.evaluate import CostModel
from planner.config import PlannerConfig
from planner.planning import plan_batch
from planner.validate import validate_plan
from tests.planner.bruteforce import optimum_step_time_s
from tests.planner.tiny import samples_of, tiny_cluster, tiny_cost_model

# The exact CP-SAT model runs on pure-Ulysses tables only (a ring's costs are not additive).
EXACT = PlannerConfig(exact_max_samples=8, exact_max_ranks=4, exact_time_limit_s=60.0,
                      memory_safety_fraction=0.0, layout="ulysses")


def _instances() -> list[tuple[str, list[int], int, int]]:
    rng = random.Random(1234)
    out = [
        ("one-long-many-short", [2400, 120, 90, 150, 60], 4, 2),
        ("memory-bound", [1200, 1250, 1300, 700], 4, 2),
        ("all-short", [80, 64, 100, 72, 90, 110], 4, 2),
        ("two-ranks", [900, 300, 1500, 200, 50], 2, 1),
        ("one-node", [2000, 1000, 400, 300, 150, 60], 4, 4),
        ("eight-samples", [1800, 900, 700, 400, 260, 130, 90, 40], 4, 2),
    ]
    for idx in range(4):
        n = rng.randint(3, 6)
        tokens = [int(math.exp(rng.uniform(math.log(40), math.log(3000)))) for _ in range(n)]
        out.append((f"random{idx}", tokens, 4, 2))
    return out


@pytest.mark.parametrize(("name", "tokens", "num_gpus", "per_node"), _instances(),
                         ids=[i[0] for i in _instances()])
def test_exact_model_matches_brute_force(name: str, tokens: list[int], num_gpus: int,
                                         per_node: int) -> None:
    cluster = tiny_cluster(num_gpus=num_gpus, gpus_per_node=per_node)
    cmf = tiny_cost_model()
    cm = CostModel(file=cmf, cluster=cluster)
    samples = samples_of(tokens)
    sizes = [d for d in cm.allowed_group_sizes() if d & (d - 1) == 0]
    best = optimum_step_time_s(samples, cm, sizes)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=EXACT)
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert plan.solver.status == "OPTIMAL", plan.solver
    assert plan.predicted_step_time_s == pytest.approx(best, rel=1e-6)
    # Every reported bound is a true bound, and a proven plan closes the gap.
    assert plan.lower_bound.value_s <= best * (1 + 1e-9)
    assert plan.gap == pytest.approx(0.0, abs=1e-6)


def test_heuristic_bounds_never_exceed_the_optimum() -> None:
    rng = random.Random(99)
    cluster = tiny_cluster(num_gpus=4, gpus_per_node=2)
    cmf = tiny_cost_model()
    cm = CostModel(file=cmf, cluster=cluster)
    for trial in range(6):
        tokens = [rng.randint(30, 2500) for _ in range(rng.randint(2, 6))]
        samples = samples_of(tokens, prefix=f"t{trial}-")
        best = optimum_step_time_s(samples, cm, [1, 2, 4])
        plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                          config=PlannerConfig(use_cpsat=False, memory_safety_fraction=0.0))
        assert plan.lower_bound.value_s <= best * (1 + 1e-9), (tokens, plan.lower_bound)
        assert plan.predicted_step_time_s >= best * (1 - 1e-9)


LP_ITERATIONS = 16
"""Bisection steps of the partition LP bounds below: every bound is at most the optimum at any count
(the LP is feasible there, checked directly); 16 steps give the same counts of raised, tighter and
memory-bound instances as 30 (17, 2 and 14 of 19)."""


def test_partition_lp_bound_never_exceeds_the_optimum() -> None:
    from planner.bounds.lp import LPInputs, lp_feasible, partition_lp_bound
    from planner.planning import prepare

    rng = random.Random(2024)
    cmf = tiny_cost_model()
    config = PlannerConfig(use_cpsat=False, memory_safety_fraction=0.0)
    raised = tighter = binds = 0
    cases = [([2400, 1300, 1250, 1200, 120, 90], 4, 2), ([1500, 1400, 1300, 300, 200], 4, 2),
             ([900, 850, 800, 60, 50], 2, 1)]
    for _ in range(9):
        cases.append(([rng.randint(30, 2500) for _ in range(rng.randint(2, 6))], 4, 2))
    # Many mid-length samples: groups run two or three micro-batches or recompute to fit.
    cases += [([600, 550, 500, 450, 400, 350, 300], 2, 1), ([900, 800, 700, 650, 600, 500], 2, 2),
              ([1100, 1000, 900, 300, 250, 200, 150], 4, 2)]
    for _ in range(4):
        cases.append(([rng.randint(150, 1100) for _ in range(rng.randint(5, 7))], 2, 2))
    for trial, (tokens, num_gpus, per_node) in enumerate(cases):
        cluster = tiny_cluster(num_gpus=num_gpus, gpus_per_node=per_node)
        cm = CostModel(file=cmf, cluster=cluster)
        samples = samples_of(tokens, prefix=f"lp{trial}-")
        sizes = [d for d in cm.allowed_group_sizes() if d & (d - 1) == 0]
        best = optimum_step_time_s(samples, cm, sizes)
        prep = prepare(samples, cluster=cluster, cost_model=cmf, config=config)
        sync = prep.table.grad_sync_s
        optimum_compute = best - sync
        # Feasible at the optimum (the optimal plan is a solution), and monotone above it.
        assert lp_feasible(prep.table, optimum_compute * (1 + 1e-9))
        assert lp_feasible(prep.table, optimum_compute * 1.5)
        lower = prep.bounds.compute_makespan_s
        assert lp_feasible(prep.table, optimum_compute * (1 + 1e-9), integral_groups=True)
        bound = partition_lp_bound(prep.table, lower_s=lower, iterations=LP_ITERATIONS)
        assert lower <= bound <= optimum_compute * (1 + 1e-9), (tokens, bound, optimum_compute)
        whole = partition_lp_bound(prep.table, lower_s=lower, iterations=LP_ITERATIONS,
                                   integral_groups=True)
        # (the MIP's tolerances differ slightly from the LP's)
        assert bound * (1 - 1e-4) <= whole <= optimum_compute * (1 + 1e-9), (tokens, whole)
        raised += bound > lower * (1 + 1e-6)
        tighter += whole > bound * (1 + 1e-3)
        # memory (byte prices and bytes rows) is what holds the LP up just below it
        without_memory = LPInputs.without_memory(prep.table)
        binds += bound > lower * (1 + 1e-6) and lp_feasible(prep.table, bound * (1 - 1e-6),
                                                            inputs=without_memory)
        # And the plan reports it only as a true bound.
        plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                          config=PlannerConfig(use_cpsat=False, memory_safety_fraction=0.0,
                                               lp_bound_iterations=LP_ITERATIONS, lp_bound_min_gap=0.0,
                                               lp_bound_integral=trial % 2 == 0))
        assert plan.lower_bound.value_s <= best * (1 + 1e-9), (tokens, plan.lower_bound)
    assert raised >= 1  # the LP is tighter than the other bounds on some instance
    assert tighter >= 1  # and whole group counts tighten it on some instance
    assert binds >= 3  # and memory on several
