"""``layout="auto"`` is never predicted slower than ``layout="ulysses"`` on the same batch.

Every workload preset (1d, 2d and 3d kinds), under its model's analytic cost model and under a
model fitted (``costmodel.fit``) from a synthetic profile of that model, on clusters of 16 to 128
GPUs; hypothesis draws the seeds, steps, batch sizes and clusters (126 batches in all). Each batch
is planned twice, once per layout, and each plan is validated; ``auto``'s plan is at most
``ulysses``' (the pure-Ulysses plan is one of its candidates, ``planner.planning``), and ``auto``
plans every batch ``ulysses`` plans.
"""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.evaluate import CostModel
from costmodel.fit import fit_profiles
from costmodel.presets import default_cost_model_file, load_cluster, load_model, workload_names
from costmodel.schema import CostModelFile
from planner.config import PlannerConfig
from planner.planning import plan_batch_with_stats
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch
from tests.costmodel.test_fit_3d import synthetic_3d_profile
from tests.costmodel.test_fit_synthetic import synthetic_profile

PRESETS = sorted(workload_names())
ANALYTIC_CLUSTERS = ("h100x16", "h100x128", "h200x24", "h200x48")
FITTED_CLUSTERS = ("h200x16", "h200x24", "h200x48")  # the synthetic profiles are of h200-sxm


@cache
def _fitted(model: str) -> CostModelFile:
    spec = load_model(model)
    profile = synthetic_3d_profile(spec, noise=0.0) if spec.kind == "3d" else synthetic_profile(spec, noise=0.0)
    return fit_profiles([profile]).file


def test_every_kind_is_covered() -> None:
    kinds = {load_model(WorkloadSpec.preset(name).model).kind for name in PRESETS}
    assert kinds == {"1d", "2d", "3d"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fitted", [False, True], ids=["analytic", "fitted"])
@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=7, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), step=st.integers(0, 50), num_samples=st.sampled_from([8, 16, 32, 48]),
       cluster_index=st.integers(0, 3))
def test_auto_is_never_slower_than_ulysses(preset: str, fitted: bool, seed: int, step: int, num_samples: int,
                                           cluster_index: int) -> None:
    _check_never_slower(preset, fitted, seed, step, num_samples, cluster_index)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), step=st.integers(0, 50), num_samples=st.sampled_from([8, 16, 32, 48]),
       cluster_index=st.integers(0, 3))
def test_auto_from_the_ulysses_plan_is_never_slower(preset: str, seed: int, step: int, num_samples: int,
                                                    cluster_index: int) -> None:
    """The large-batch path (``ulysses_seeded_min_samples``: the Ulysses plan relaid out, against
    ``auto``'s baselines) on small batches, with the threshold at the batch size."""
    _check_never_slower(preset, False, seed, step, num_samples, cluster_index, seeded_min_samples=num_samples)


def _check_never_slower(preset: str, fitted: bool, seed: int, step: int, num_samples: int, cluster_index: int,
                        seeded_min_samples: int | None = None) -> None:
    spec = WorkloadSpec.preset(preset)
    clusters = FITTED_CLUSTERS if fitted else ANALYTIC_CLUSTERS
    cluster = load_cluster(clusters[cluster_index % len(clusters)])
    cmf = _fitted(spec.model) if fitted else default_cost_model_file(spec.model, cluster.hardware.name)
    cm = CostModel(file=cmf, cluster=cluster)
    samples = sample_batch(spec, num_samples=num_samples, seed=seed, step=step)
    seeded = {} if seeded_min_samples is None else {"ulysses_seeded_min_samples": seeded_min_samples}
    plans = {}
    for layout in ("auto", "ulysses"):
        try:
            plans[layout] = plan_batch_with_stats(samples, cluster=cluster, cost_model=cmf,
                                                  config=PlannerConfig(seed=seed, layout=layout, **seeded),
                                                  step=step,
                                                  reference_sample=spec.max_sample)
        except ValueError:  # a sample fits no group of the layout (auto's groups include ulysses')
            plans[layout] = None
    if plans["auto"] is None:
        assert plans["ulysses"] is None  # what Ulysses holds, auto holds
        return
    auto, auto_stats = plans["auto"]
    assert validate_plan(auto, samples, cost_model=cm) == []
    if plans["ulysses"] is not None:
        ulysses = plans["ulysses"][0]
        assert validate_plan(ulysses, samples, cost_model=cm) == []
        assert auto.predicted_step_time_s <= ulysses.predicted_step_time_s * (1 + 1e-9), (
            auto.solver, ulysses.solver, auto_stats.ulysses_step_time_s)
        if seeded_min_samples is not None and auto_stats.ulysses_step_time_s is not None:  # the path ran
            assert auto_stats.ulysses_step_time_s == ulysses.predicted_step_time_s  # the same Ulysses plan
