"""``ring-cp`` and ``usp``: one CP size and layout for the run, samples balanced by tokens, every
sample once, and plans the validator accepts (issue 25, item 4)."""

from __future__ import annotations

import pytest

from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from planner.assemble import Draft, PlanMeta, assemble_plan, draft_step_time_s
from planner.baselines import REGISTRY, baseline_drafts, strongest
from planner.baselines.fixed_cp import fixed_cp_draft
from planner.baselines.ring_cp import ring_cp_draft, ring_layout
from planner.baselines.usp import usp_draft, usp_layout
from planner.config import AttentionLayout, PlannerConfig
from planner.costs import CostTable
from planner.plan import LowerBound
from planner.planning import plan_batch, plan_batch_with_stats, prepare
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch

# The workload's longest sample (1M tokens) fits a ring of 16 on h200x64 since the LM loss runs in
# chunks (36 GiB per rank fully checkpointed, 65.5 GiB left); 2M tokens need 71 GiB on 16 ranks and
# 36 GiB on 32, so this reference puts the ring past the 16 ranks of a half-head Ulysses group.
TWO_M = Sample(id="2M", tokens=2 * 1024 * 1024)


def _table(workload: str, cluster_name: str, num_samples: int, *, model: str | None = None,
           step: int = 0, layout: AttentionLayout = "auto") -> tuple[CostTable, Sample]:
    spec = WorkloadSpec.preset(workload)
    if model is not None:
        spec = spec.model_copy(update={"model": model})
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=num_samples, seed=0, step=step)
    return prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout=layout)).table, \
        spec.max_sample


def _smallest_fitting_size(table: CostTable, longest: Sample, ring_degree_of) -> int:  # type: ignore[no-untyped-def]
    """Reference: the first divisor of the world on which the cost model says the sample fits
    fully checkpointed (``CostModel.fits``, one sample at a time; no code of ``fixed_cp``)."""
    cm = table.cost_model
    n = cm.cluster.num_gpus
    k_full = cm.num_layers - 1
    cap = table.budget_bytes
    for d in range(1, n + 1):
        if n % d:
            continue
        r = ring_degree_of(d)
        layout = cm.place(first_rank=0, group_size=d, ring_degree=r)
        act = float(cm.activation_bytes(longest.tokens, group_size=d, recompute_layers=k_full, layout=layout))
        if act <= cap and (r == 1 or longest.tokens >= 2 * r):
            return d
    raise AssertionError("no size holds the longest sample")


def _check_structure(draft: Draft, table: CostTable, *, size: int, ring_degree: int) -> None:
    n = table.cost_model.cluster.num_gpus
    assert [g.size for g in draft] == [size] * (n // size)
    assert [g.first_rank for g in draft] == list(range(0, n, size))
    assert {g.ring_degree for g in draft} == {ring_degree}
    placed = sorted(i for g in draft for mb in g.micro_batches for i, _ in mb)
    assert placed == list(range(len(table.samples)))  # every sample exactly once
    # Balanced by tokens (longest first to the replica with the fewest): no two replicas differ
    # by more than the longest sample.
    tokens = [sum(table.samples[i].tokens for mb in g.micro_batches for i, _ in mb) for g in draft]
    assert max(tokens) - min(tokens) <= max(s.tokens for s in table.samples)


@pytest.mark.timeout(120)
def test_ring_cp_on_million_token_text_is_one_ring_per_replica_at_the_smallest_fitting_size() -> None:
    table, _ = _table("text-millionctx", "h200x64", 64)
    longest = TWO_M
    size = _smallest_fitting_size(table, longest, lambda d: d)
    assert size == 32 and size > table.cost_model.file.model.num_heads // 2  # 2M tokens: past 16 ranks
    draft = ring_cp_draft(table, reference=longest)
    assert draft is not None
    _check_structure(draft, table, size=size, ring_degree=size)


@pytest.mark.timeout(120)
def test_usp_keeps_ulysses_inside_a_node_and_rings_across() -> None:
    table, longest = _table("text-millionctx", "h200x64", 64)
    cm = table.cost_model
    assert usp_layout(cm, 32) == 4 and usp_layout(cm, 8) == 1 and usp_layout(cm, 4) == 1
    size = _smallest_fitting_size(table, longest, lambda d: usp_layout(cm, d))
    draft = usp_draft(table, reference=longest)
    assert draft is not None
    _check_structure(draft, table, size=size, ring_degree=size // 8)


def test_usp_takes_the_largest_ulysses_degree_the_heads_and_the_node_allow() -> None:
    table, _ = _table("video3d-longclip", "h200x64", 8)  # Wan2.1-1.3B: 12 heads, sizes 1, 2, 3, 4, 6, 12
    cm = table.cost_model
    # u = d / r: 6 and 12 divide neither an 8-GPU node nor these sizes, so u stops at 4.
    assert [d // usp_layout(cm, d) for d in (1, 2, 4, 8, 16, 32)] == [1, 2, 4, 4, 4, 4]
    assert ring_layout(cm, 16) == 16


def test_the_size_is_fixed_by_the_workloads_longest_sample_not_the_batch() -> None:
    table, longest = _table("text-longcontext", "h200x32", 16, model="llama-3.1-8b")
    fixed = ring_cp_draft(table, reference=longest)
    per_batch = ring_cp_draft(table, reference=None)  # the batch's own longest
    assert fixed is not None and per_batch is not None
    assert fixed[0].size == _smallest_fitting_size(table, longest, lambda d: d) == 4  # 256k tokens
    batch_longest = max(table.samples, key=lambda s: s.tokens)
    assert per_batch[0].size == _smallest_fitting_size(table, batch_longest, lambda d: d) <= fixed[0].size
    # A size picked for a shorter sample than the batch's longest cannot hold the batch.
    assert ring_cp_draft(table, reference=Sample(id="short", tokens=1024)) is None


def test_a_layout_that_cannot_hold_the_batch_is_reported_not_dropped() -> None:
    table, _ = _table("text-millionctx", "h200x64", 64)
    longest = TWO_M
    # A 2-token sample cannot be cut into the 2 x 32 chunks of a 32-rank ring.
    tiny = prepare([*table.samples, Sample(id="tiny", tokens=2)], cluster=table.cost_model.cluster,
                   cost_model=table.cost_model.file, config=PlannerConfig(layout="auto")).table
    assert ring_cp_draft(tiny, reference=longest) is None
    missed: list[str] = []
    drafts = baseline_drafts(tiny, reference=longest, not_holding=missed)
    assert "ring-cp" not in drafts and "ring-cp" in missed
    assert sorted([*drafts, *missed]) == sorted(REGISTRY)
    # A 2D model: a ring cannot split spatial and temporal attention.
    video, ref = _table("video-short", "h200x32", 32, layout="ulysses")
    assert fixed_cp_draft(video, rule=ring_layout, reference=ref) is None
    assert usp_draft(video, reference=ref) is None


def test_only_the_layouts_the_planner_allows_are_built() -> None:
    # layout="ulysses" (the default) allows no ring: neither holds past 8 ranks; "ring" no hybrid.
    ulysses, _ = _table("text-millionctx", "h200x64", 16, layout="ulysses")
    longest = TWO_M
    assert ring_cp_draft(ulysses, reference=longest) is None and usp_draft(ulysses, reference=longest) is None
    ring, _ = _table("text-millionctx", "h200x64", 16, layout="ring")
    assert ring_cp_draft(ring, reference=longest) is not None and usp_draft(ring, reference=longest) is None
    # Where the longest sample fits a node, USP is pure Ulysses: any layout allows it.
    text, ref = _table("text-longcontext", "h200x32", 16, model="llama-3.1-8b", layout="ulysses")
    draft = usp_draft(text, reference=ref)
    size = _smallest_fitting_size(text, ref, lambda d: d)
    assert size <= 8 and draft is not None and {(g.size, g.ring_degree) for g in draft} == {(size, 1)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("workload", "cluster_name", "num_samples", "model"), [
    ("text-millionctx", "h200x64", 64, None),
    ("video3d-longclip", "h200x64", 32, None),
    ("text-longcontext", "h200x32", 32, "llama-3.1-8b"),
])
def test_fixed_cp_plans_pass_the_validator(workload: str, cluster_name: str, num_samples: int,
                                           model: str | None) -> None:
    table, longest = _table(workload, cluster_name, num_samples, model=model)
    ids = sorted(s.id for s in table.samples)
    for name in ("ring-cp", "usp"):
        draft = REGISTRY[name].build(table, seed=0, reference=longest)
        assert draft is not None, name
        plan = assemble_plan(draft, table.samples, cost_model=table.cost_model, meta=PlanMeta(
            status="BASELINE", method=name, wall_time_s=0.0, lower_bound=LowerBound(value_s=0.0, kind="none")))
        assert validate_plan(plan, table.samples, cost_model=table.cost_model) == [], name
        assert sorted(plan.sample_ids) == ids
        assert {g.ring_degree for g in plan.groups} == {draft[0].ring_degree}


@pytest.mark.timeout(300)
def test_the_strongest_baseline_includes_ring_cp_and_usp_where_they_hold() -> None:
    spec = WorkloadSpec.preset("text-millionctx")
    cluster = load_cluster("h200x64")
    samples = sample_batch(spec, num_samples=64, seed=0, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=default_cost_model_file(spec.model, "h200-sxm"),
                      config=PlannerConfig(layout="auto"), reference_sample=TWO_M)
    assert {"ring-cp", "usp"} <= set(plan.baselines_s)
    # Recorded at their own fixed layouts (32 ranks as one ring; 8 x 4), not re-chosen by the planner.
    prep = prepare(samples, cluster=cluster, cost_model=default_cost_model_file(spec.model, "h200-sxm"),
                   config=PlannerConfig(layout="auto"))
    for name, ring_degree in (("ring-cp", 32), ("usp", 4)):
        draft = REGISTRY[name].build(prep.table, seed=0, reference=TWO_M)
        assert draft is not None and {g.ring_degree for g in draft} == {ring_degree}
        assert plan.baselines_s[name] == pytest.approx(draft_step_time_s(draft, prep.arrays, prep.cost_model),
                                                       rel=1e-12), name
    best = strongest(plan.baselines_s)
    assert best is not None and best[1] == min(t for n, t in plan.baselines_s.items() if n != "naive")
    assert plan.predicted_step_time_s <= best[1] * (1 + 1e-9)


@pytest.mark.timeout(300)
def test_a_planner_that_allows_no_ring_records_them_as_not_holding() -> None:
    spec = WorkloadSpec.preset("text-millionctx")
    samples = sample_batch(spec, num_samples=32, seed=0, step=0)
    plan, stats = plan_batch_with_stats(samples, cluster=load_cluster("h200x64"),
                                        cost_model=default_cost_model_file(spec.model, "h200-sxm"),
                                        config=PlannerConfig(layout="ulysses"), reference_sample=TWO_M)
    assert {"ring-cp", "usp"} <= set(stats.baselines_not_holding)  # 32 ranks for 2M tokens: 1x32, 8x4
    assert not set(stats.baselines_not_holding) & set(plan.baselines_s)
    assert sorted([*stats.baselines_not_holding, *plan.baselines_s]) == sorted(REGISTRY)
    assert all(g.ring_degree == 1 for g in plan.groups)
