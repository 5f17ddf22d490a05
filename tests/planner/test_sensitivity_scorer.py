"""The scorer of ``bench/model_sensitivity.py``: a plan scored under the model it was made with
gives the plan's own predictions, perturbations change exactly the term they name, and a model
error that changes nothing costs nothing."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.planning import plan_batch
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "model_sensitivity.py"


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_model_sensitivity", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


ms = _load_bench()


@pytest.fixture(scope="module", params=["text-longtail", "video-short"])
def case(request: pytest.FixtureRequest) -> tuple:
    """A 48-sample batch on 32 H200s (nodes of 8: node-crossing groups possible) and its plan."""
    spec = WorkloadSpec.preset(request.param)
    cluster = load_cluster("h200x32")
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=48, seed=3, step=1)
    config = PlannerConfig()
    plan = plan_batch(samples, cluster=cluster, cost_model=file, config=config,
                      reference_sample=spec.max_sample)
    return spec, cluster, file, samples, config, plan


def test_score_under_own_model_equals_the_plans_predictions(case: tuple) -> None:
    _, cluster, file, _, _, plan = case
    score = ms.score_plan(plan, CostModel(file=file, cluster=cluster))
    assert math.isclose(score.step_time_s, plan.predicted_step_time_s, rel_tol=1e-9)
    assert math.isclose(score.grad_sync_time_s, plan.grad_sync_time_s, rel_tol=1e-9)
    assert math.isclose(score.compute_makespan_s, max(g.predicted_time_s for g in plan.groups),
                        rel_tol=1e-9)
    assert math.isclose(score.peak_mem_bytes, max(g.predicted_peak_mem_bytes for g in plan.groups),
                        rel_tol=1e-9)
    assert score.num_microbatches == sum(len(g.micro_batches) for g in plan.groups)
    assert score.feasible


@pytest.mark.parametrize("term", ms.TERMS)
def test_perturbation_scales_its_term(case: tuple, term: str) -> None:
    """+30% on a time term makes the plan slower, by at most 30% (time is linear in every
    coefficient), and leaves memory alone; on memory, the reverse; a factor of 1 changes no
    coefficient."""
    _, cluster, file, _, _, plan = case
    base = ms.score_plan(plan, CostModel(file=file, cluster=cluster))
    unchanged = ms.perturb(file, term=term, factor=1.0)
    assert unchanged.model_dump(exclude={"id"}) == file.model_dump(exclude={"id"})
    assert unchanged.id != file.id
    up = ms.score_plan(plan, CostModel(file=ms.perturb(file, term=term, factor=1.3), cluster=cluster))
    crosses_nodes = any(nodes_spanned(first_rank=g.first_rank, group_size=g.size,
                                      gpus_per_node=cluster.gpus_per_node) > 1 for g in plan.groups)
    if term == "memory":
        assert up.step_time_s == base.step_time_s
        assert up.peak_mem_bytes > base.peak_mem_bytes
    elif term == "alltoall-inter" and not crosses_nodes:
        assert up.step_time_s == base.step_time_s
    else:
        assert up.step_time_s > base.step_time_s
        assert up.compute_makespan_s <= 1.3 * base.compute_makespan_s * (1 + 1e-12)
        assert up.peak_mem_bytes == base.peak_mem_bytes


def test_over_cap_count_agrees_with_validate_plan(case: tuple) -> None:
    """Activation bytes scaled just past the cap for the plan's fullest micro-batch: it (and
    maybe others) is over the cap, and validate_plan lists exactly those."""
    _, cluster, file, samples, _, plan = case
    cm = CostModel(file=file, cluster=cluster)
    fullest_bytes = max(g.predicted_peak_mem_bytes for g in plan.groups) - cm.fixed_bytes()
    factor = 1.01 * cm.activation_budget_bytes() / fullest_bytes
    truth = CostModel(file=ms.perturb(file, term="memory", factor=factor), cluster=cluster)
    score = ms.score_plan(plan, truth)
    over_cap = [p for p in validate_plan(plan, samples, cost_model=truth) if "exceeds the cap" in p]
    assert score.num_microbatches_over_cap == len(over_cap) >= 1
    assert not score.feasible
    assert ms.score_plan(plan, CostModel(file=ms.perturb(file, term="memory", factor=0.99 * factor),
                                         cluster=cluster)).feasible


def test_no_model_error_costs_nothing(case: tuple) -> None:
    spec, cluster, file, samples, config, plan = case
    row = ms.step_sensitivity(samples, cluster=cluster, believed=file,
                              truth=ms.perturb(file, term="compute", factor=1.0), config=config,
                              plan=plan, reference_sample=spec.max_sample)
    assert row.loss == 0.0
    assert not row.replan_changed
    assert row.feasible
    assert math.isclose(row.true_s, plan.predicted_step_time_s, rel_tol=1e-9)
    assert row.replanned_believed_s == row.replanned_s == row.true_s


def test_alltoall_error_is_free_when_every_group_has_one_rank() -> None:
    """Groups of size 1 issue no all-to-all: a 30% all-to-all error changes neither plan nor time."""
    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster("h200x8")
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = [s for s in sample_batch(spec, num_samples=64, seed=0) if s.tokens <= 8192][:24]
    config = PlannerConfig(group_sizes=(1,))
    row = ms.step_sensitivity(samples, cluster=cluster, believed=file,
                              truth=ms.perturb(file, term="alltoall", factor=1.3), config=config,
                              reference_sample=max(samples, key=lambda s: s.tokens))
    assert row.group_sizes == [1] * 8
    assert row.loss == 0.0
    assert not row.replan_changed
    assert row.true_s == row.believed_s
