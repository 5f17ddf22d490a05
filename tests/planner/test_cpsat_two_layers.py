"""Regression: the exact CP-SAT model of a two-layer model (docs/training.md's Latte example) called a
feasible placement infeasible and reported a bound twice the plan's step time (BoundError).

With ``L = 2`` layers a sample recomputes at most ``k_top = 1`` layer, so the first recomputed
layer's saving is all of it: the model's memory term ``a0 + z*jump - k*slope`` has ``slope = 0``
and ``jump = a1 - a0 < 0``, which a clamp to 0 turned into "recomputing saves nothing"."""

from __future__ import annotations

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.specs import ModelSpec, Sample
from planner.config import PlannerConfig
from planner.placement import place_groups
from planner.planning import plan_batch, prepare
from planner.validate import validate_plan

# examples/train_hf_latte.py's model as the cost model sees it, on 4 CPU ranks whose memory is cut
# so that 96 tokens fill a rank (examples/common.py, --memory-tokens 96).
SPEC = ModelSpec(name="hf-latte-tiny", kind="2d", num_layers=2, hidden=64, num_heads=4, ffn_hidden=256,
                 causal=False)
SHAPES = [("clip-11", 4, 6, 4), ("clip-57", 1, 6, 2), ("clip-37", 1, 4, 6), ("clip-20", 4, 6, 4),
          ("clip-18", 1, 2, 6), ("clip-61", 1, 2, 6), ("clip-3", 4, 6, 2), ("clip-1", 4, 6, 4)]
"""Step 2 of the example's epoch (seed 0, 8 samples a step)."""


def _cluster():  # type: ignore[no-untyped-def]
    base = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": 4, "gpus_per_node": 4})
    model = CostModel(file=analytic_cost_model(SPEC, base.hardware), cluster=base)
    need = model.fixed_bytes() + float(model.activation_bytes(96, group_size=1))
    hardware = base.hardware.model_copy(update={"name": "h200-sxm-tight", "hbm_bytes": need / base.memory_cap_fraction})
    return base.model_copy(update={"hardware": hardware, "name": "cpu4-tight"})


def test_latte_step_plans_without_a_bound_error() -> None:
    cluster = _cluster()
    file = analytic_cost_model(SPEC, cluster.hardware)
    samples = [Sample(id=i, frames=f, height=h, width=w) for i, f, h, w in SHAPES]
    plan = plan_batch(samples, cluster=cluster, cost_model=file,
                      config=PlannerConfig(time_limit_s=0.5, seed=1384580204, exact_time_limit_s=600.0), step=2)
    assert plan.lower_bound.value_s <= plan.predicted_step_time_s * (1 + 1e-9)
    assert validate_plan(plan, samples, cost_model=CostModel(file=file, cluster=cluster)) == []
    # the exact model proves it, with a bound that holds (its wall-clock cap set far out: on a busy
    # 2-core machine the default 5 s can end the proof early)
    assert plan.solver.status == "OPTIMAL"


def test_exact_model_accepts_one_recomputed_layer_of_two() -> None:
    from ortools.sat.python import cp_model

    from planner.search.cpsat import _solver, build_exact_model

    cluster = _cluster()
    file = analytic_cost_model(SPEC, cluster.hardware)
    samples = [Sample(id=i, frames=f, height=h, width=w) for i, f, h, w in SHAPES]
    config = PlannerConfig(time_limit_s=0.5)
    table = prepare(samples, cluster=cluster, cost_model=file, config=config).table
    placed = place_groups([1, 1, 1, 1], num_gpus=4, gpus_per_node=4)
    assert placed is not None
    em = build_exact_model(table, placed)
    assert em is not None
    solver = _solver(config, wall_s=10.0, deterministic_s=None)
    assert solver.solve(em.model) == cp_model.OPTIMAL
