"""Every plan the planner returns runs: policies in range, every micro-batch under the memory cap.

Two batches that once came back wrong under ``layout="auto"`` at ``h100x128`` (Wan2.1-14B, analytic
model, 40 heads: sizes 16-128 run only as rings):

* ``data/bound-error-wan14b-h100x128.jsonl`` (256 clips, step 3): the ``dcp-greedy`` baseline sized
  its groups for pure Ulysses, the groups then ran the table's ring layout of their size, whose
  activations did not fit; the polish seeded its local search with samples that fit no layout of
  their group (``inf - inf`` in the local search) and returned them at ``recompute_layers = -1``
  with a predicted peak over the cap. With strict bounds the planner raised ``BoundError`` (the
  ``largest-choice`` bound, right, above the invalid plan); without, it returned the plan.
* ``video3d-long``, 256 clips of seed 0, step 7: the same path, returned as ``dcp-greedy+search``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.assemble import DraftGroup, draft_problems
from planner.baselines import baseline_drafts, with_layouts
from planner.config import PlannerConfig
from planner.layouts import ring_chunks_fit
from planner.planning import InvalidPlanError, check_draft, plan_batch_with_stats, prepare
from planner.search.polish import polish
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, read_manifest, sample_batch

DATA = Path(__file__).parent / "data"
REPRO = DATA / "bound-error-wan14b-h100x128.jsonl"


def _wan(cluster: str = "h100x128", **overrides: float) -> CostModel:
    spec = load_cluster(cluster, **overrides)
    return CostModel(file=default_cost_model_file("wan2.1-14b", spec.hardware.name), cluster=spec)


def _assert_runs(plan, samples, cm: CostModel) -> None:  # type: ignore[no-untyped-def]
    assert validate_plan(plan, samples, cost_model=cm) == []
    layers = cm.num_layers
    assert all(0 <= ps.recompute_layers <= layers for g in plan.groups for mb in g.micro_batches for ps in mb.samples)
    assert max(g.predicted_peak_mem_bytes for g in plan.groups) <= cm.cluster.memory_cap_bytes
    assert plan.lower_bound.value_s <= plan.predicted_step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("strict", [True, False])
def test_the_bound_error_batch_plans_validly(strict: bool) -> None:
    samples = read_manifest(REPRO)
    assert len(samples) == 256
    cm = _wan()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the local search's inf - inf
        plan, stats = plan_batch_with_stats(samples, cluster=cm.cluster, cost_model=cm.file,
                                            config=PlannerConfig(seed=0, layout="auto", strict_bounds=strict), step=3)
    _assert_runs(plan, samples, cm)
    assert stats.dropped_bounds == ()
    # The longest clip (334,560 tokens) fits only the largest groups: the bound that says so holds.
    # (127.498813 s before the counted Wan bytes and the all-to-all buffers charged only where a
    # Ulysses group of several ranks runs: a pure ring now holds none; 80.027247 s while the
    # bounds charged a ring's compute alone, before the hop-bound form of costmodel/ring/timing.py's
    # ring_steps_s counted the cross-node hops of the rings that hold it; 134.525155 s while a
    # column's form was picked by sample counts, not by their attention work; the plan: 154.3 s.)
    assert plan.lower_bound.kind == "largest-choice"
    assert plan.lower_bound.value_s == pytest.approx(113.180090, rel=1e-6)


def test_video3d_long_step_7_plans_validly() -> None:
    spec = WorkloadSpec.preset("video3d-long")
    samples = _video3d_long_step_7()
    cm = _wan()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        plan, stats = plan_batch_with_stats(samples, cluster=cm.cluster, cost_model=cm.file,
                                            config=PlannerConfig(seed=0, layout="auto", strict_bounds=False),
                                            step=7, reference_sample=spec.max_sample)
    _assert_runs(plan, samples, cm)
    assert stats.dropped_bounds == ()


def _video3d_long_step_7() -> list:  # type: ignore[type-arg]
    return sample_batch(WorkloadSpec.preset("video3d-long"), num_samples=256, seed=0, step=7)


@pytest.mark.parametrize("cap", [0.8, 0.9])
@pytest.mark.parametrize("batch", ["repro", "video3d-long"])
def test_every_baseline_fits_the_layout_it_runs(cap: float, batch: str) -> None:
    """Each baseline's groups run their size's layout in the table: each is priced under it, so
    each draft that holds the batch fits the cap (the cause of both batches above)."""
    samples = read_manifest(REPRO) if batch == "repro" else _video3d_long_step_7()
    cm = _wan(memory_cap_fraction=cap)
    prep = prepare(samples, cluster=cm.cluster, cost_model=cm.file, config=PlannerConfig(layout="auto"))
    table = prep.table
    limit = cm.fixed_bytes() + table.budget_bytes
    drafts = baseline_drafts(table, seed=0)
    assert batch == "repro" or "dcp-greedy" in drafts
    for name, draft in drafts.items():
        draft = with_layouts(name, draft, table)
        if ring_chunks_fit(draft, prep.arrays):
            assert draft_problems(draft, prep.arrays, cm, limit_bytes=limit) == [], name


def test_polish_refuses_groups_the_table_cannot_price() -> None:
    samples = read_manifest(REPRO)
    cm = _wan()
    prep = prepare(samples, cluster=cm.cluster, cost_model=cm.file, config=PlannerConfig(layout="auto"))
    table = prep.table
    longest = max(range(len(samples)), key=lambda i: samples[i].tokens)
    assert table.smallest_fitting_size(longest) == 128  # fits no group of 64 under any layout
    others = [(i, 0) for i in range(len(samples)) if i != longest]
    draft = [DraftGroup(size=64, first_rank=0, micro_batches=[[(longest, 0)]]),
             DraftGroup(size=64, first_rank=64, micro_batches=[others])]
    assert polish(table, draft, max_moves=10, intra=True) is None


def test_a_draft_over_the_cap_or_with_a_policy_out_of_range_is_refused_loudly() -> None:
    samples = read_manifest(REPRO)
    cm = _wan()
    prep = prepare(samples, cluster=cm.cluster, cost_model=cm.file, config=PlannerConfig(layout="auto"))
    limit = cm.fixed_bytes() + prep.table.budget_bytes
    longest = max(range(len(samples)), key=lambda i: samples[i].tokens)
    rest = [(i, cm.num_layers - 1) for i in range(len(samples)) if i != longest]
    fits = [DraftGroup(size=128, first_rank=0, ring_degree=16,
                       micro_batches=[[(longest, cm.num_layers - 1)]] + [[p] for p in rest])]
    assert draft_problems(fits, prep.arrays, cm, limit_bytes=limit) == []
    over = [DraftGroup(size=64, first_rank=0, ring_degree=8, micro_batches=[[(longest, cm.num_layers - 1)]]),
            DraftGroup(size=64, first_rank=64, ring_degree=8, micro_batches=[[p] for p in rest])]
    problems = draft_problems(over, prep.arrays, cm, limit_bytes=limit)
    assert len(problems) == 1 and "peak over the limit" in problems[0]
    negative = [DraftGroup(size=128, first_rank=0, ring_degree=16,
                           micro_batches=[[(longest, -1)]] + [[p] for p in rest])]
    assert "outside [0, 40]" in draft_problems(negative, prep.arrays, cm, limit_bytes=limit)[0]
    with pytest.raises(InvalidPlanError, match="the plan cannot run"):
        check_draft(over, prep.arrays, cm, limit_bytes=limit, what="the plan", samples=samples)
