"""Every baseline yields a valid plan holding each sample once, and follows its documented rule."""

from __future__ import annotations

import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from dcp_cli.plan import BASELINES as LEGEND
from planner.assemble import BatchArrays, Draft, PlanMeta, assemble_plan, draft_step_time_s
from planner.baselines import REGISTRY, baseline_drafts, strongest
from planner.baselines.bucket import bucket_batch_size, bucket_draft
from planner.baselines.common import full_checkpoint_layers, shape_buckets
from planner.baselines.dcp_greedy import accumulation_count, dcp_greedy_draft
from planner.baselines.megatron_dyncp import cp_size, max_tokens_per_rank, megatron_dyncp_draft
from planner.baselines.naive import naive_draft
from planner.baselines.static_best import lpt_draft, static_best_draft
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.plan import LowerBound
from planner.planning import prepare
from planner.validate import validate_plan
from planner.workload import WorkloadSpec, sample_batch
from tests.planner.tiny import samples_of, tiny_cluster, tiny_cost_model


def _preset_table(workload: str, cluster_name: str, num_samples: int) -> tuple[CostTable, Sample]:
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=num_samples, seed=4, step=1)
    return prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout="ulysses")).table, \
        spec.max_sample


def _tiny_table(tokens: list[int], *, num_gpus: int = 4, gpus_per_node: int = 2,
                num_heads: int = 4) -> CostTable:
    cluster = tiny_cluster(num_gpus=num_gpus, gpus_per_node=gpus_per_node)
    return prepare(samples_of(tokens), cluster=cluster, cost_model=tiny_cost_model(num_heads=num_heads),
                   config=PlannerConfig()).table


def _working(draft: Draft) -> list:  # type: ignore[type-arg]
    return [g for g in draft if g.micro_batches]


ALL = set(REGISTRY)
FIXED_CP = {"ring-cp", "usp"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workload", "cluster_name", "num_samples", "expected"), [
    ("video-balanced", "h200x32", 80, ALL - FIXED_CP),  # a ring cannot split 2D attention
    ("video-short", "h200x64", 200, ALL - FIXED_CP),
    # layout="ulysses" allows no ring: ring-cp holds no batch; usp holds where its
    # size fits a node (it is then Ulysses over that size).
    ("text-longtail", "h200x8", 120, ALL - {"bucket-sp1", "ring-cp"}),
    # With the chunked loss (no whole logits) but the bytes LlamaDecoderLayer really keeps (its
    # RMSNorms' fp32 copies: costmodel/presets/activation_bytes.json) the longest documents need 4
    # ranks: bucket-sp2 holds no batch.
    ("text-longcontext", "h200x32", 48, ALL - {"bucket-sp1", "bucket-sp2", "naive", "ring-cp"}),
])
def test_every_baseline_plan_is_valid_and_holds_each_sample_once(
        workload: str, cluster_name: str, num_samples: int, expected: set[str]) -> None:
    table, reference = _preset_table(workload, cluster_name, num_samples)
    drafts = baseline_drafts(table, seed=3, reference=reference)
    assert set(drafts) == expected
    ids = sorted(s.id for s in table.samples)
    for name, draft in drafts.items():
        plan = assemble_plan(draft, table.samples, cost_model=table.cost_model, meta=PlanMeta(
            status="BASELINE", method=name, wall_time_s=0.0,
            lower_bound=LowerBound(value_s=0.0, kind="none")))
        assert validate_plan(plan, table.samples, cost_model=table.cost_model) == [], name
        assert sorted(plan.sample_ids) == ids, name


def test_the_cli_legend_names_every_registered_baseline() -> None:
    assert set(LEGEND) == set(REGISTRY) | {"strongest"}


def test_strongest_is_the_fastest_baseline_but_naive() -> None:
    assert strongest({"naive": 1.0, "static-best": 3.0, "dcp-greedy": 2.0}) == ("dcp-greedy", 2.0)
    assert strongest({"naive": 1.0}) is None


def test_bucket_cuts_each_bucket_into_its_largest_batch_and_deals_round_robin() -> None:
    # Buckets (1D, power-of-two ranges): (1024, 2048] and (64, 128], interleaved in the sampler.
    tokens = [1100, 100, 1500, 90, 2000, 120, 110, 70, 1300]
    table = _tiny_table(tokens)
    draft = bucket_draft(table, group_size=2)
    assert draft is not None
    assert [g.size for g in draft] == [2, 2]
    k_full = full_checkpoint_layers(table.cost_model.num_layers)
    assert k_full == 2
    buckets = shape_buckets(table)
    assert buckets == [[0, 2, 4, 8], [1, 3, 5, 6, 7]]
    sizes = [bucket_batch_size(table, m, group_size=2) for m in buckets]
    assert 1 <= sizes[0] < 4 and sizes[1] >= 1  # memory binds the long bucket
    chunks = [m[a:a + b] for m, b in zip(buckets, sizes, strict=True) for a in range(0, len(m), b)]
    dealt: list[list[list[int]]] = [[], []]
    for turn, chunk in enumerate(chunks):
        dealt[turn % 2].append(chunk)
    for g, expected in zip(draft, dealt, strict=True):
        assert [[i for i, _ in mb] for mb in g.micro_batches] == expected
        assert all(k == k_full for mb in g.micro_batches for _, k in mb)
    # The largest batch: one more sample of the bucket's longest would exceed the budget.
    cm = table.cost_model
    per = float(cm.activation_bytes(2000, group_size=2, recompute_layers=k_full))
    assert sizes[0] * per <= table.budget_bytes < (sizes[0] + 1) * per


def test_bucket_size_fixed_for_the_run_must_hold_the_workload_longest_sample() -> None:
    table = _tiny_table([600, 100])
    assert bucket_draft(table, group_size=1) is not None
    assert bucket_draft(table, group_size=1, reference=Sample(id="max", tokens=3400)) is None
    assert bucket_draft(table, group_size=4, reference=Sample(id="max", tokens=3400)) is not None
    assert bucket_draft(table, group_size=3) is None  # not an allowed size


def test_megatron_cp_size_is_the_next_power_of_two_of_length_over_tokens_per_rank() -> None:
    probe = _tiny_table([100], num_gpus=8, gpus_per_node=4, num_heads=8)
    tpr = max_tokens_per_rank(probe)
    per_token = float(probe.cost_model.activation_bytes(1, group_size=1, recompute_layers=0))
    assert tpr * per_token <= probe.budget_bytes < (tpr + 1) * per_token
    tokens = [tpr // 2, 3 * tpr, tpr, tpr + 1]
    table = _tiny_table(tokens, num_gpus=8, gpus_per_node=4, num_heads=8)
    assert [cp_size(table, i, tokens_per_rank=tpr) for i in range(4)] == [1, 4, 1, 2]
    draft = megatron_dyncp_draft(table)
    assert draft is not None
    size_of = {i: g.size for g in draft for mb in g.micro_batches for i, _ in mb}
    # Longest first, each on a new group of its CP size while ranks are free: 4 + 2 + 1 + 1.
    assert size_of == {1: 4, 3: 2, 2: 1, 0: 1}
    assert sum(g.size for g in draft) == 8 and all(g.micro_batches for g in draft)


def test_megatron_fills_free_ranks_by_doubling_the_most_loaded_group() -> None:
    table = _tiny_table([200, 100], num_gpus=8, gpus_per_node=4, num_heads=8)
    draft = megatron_dyncp_draft(table)
    assert draft is not None
    size_of = {i: g.size for g in draft for mb in g.micro_batches for i, _ in mb}
    # Two groups of 1, 6 ranks free; seconds per sample on 1/2/4 ranks: 5.2/3.3/2.3 ms and
    # 3.1/2.2/1.7 ms. Doubling the most loaded group that fits the free ranks: sample 0 to 2
    # (3.3 > 3.1), to 4; sample 1 to 2 (3.1 > 2.3); sample 1 to 4 (sample 0's 4 > 2 free).
    assert size_of == {0: 4, 1: 4}
    assert sum(g.size for g in draft) == 8


def test_static_best_is_the_fastest_lpt_size_and_lpt_balances_within_one_sample() -> None:
    table, _ = _preset_table("text-longtail", "h200x32", 150)
    arrays = BatchArrays.of(table.samples)
    times = {d: draft_step_time_s(dr, arrays, table.cost_model)
             for d in table.sizes if (dr := lpt_draft(table, group_size=d)) is not None}
    best = static_best_draft(table)
    assert best is not None
    assert draft_step_time_s(best, arrays, table.cost_model) == pytest.approx(min(times.values()))
    assert len({g.size for g in _working(best)}) == 1
    for d in times:
        draft = lpt_draft(table, group_size=d)
        assert draft is not None
        j = table.size_index(d)
        cls = table.classes.class_of
        loads = [sum(float(table.time_s[cls[i], j]) for mb in g.micro_batches for i, _ in mb)
                 for g in draft if g.size == d]
        biggest = max(float(table.time_s[cls[i], j]) for i in range(len(table.samples)))
        assert max(loads) - min(loads) <= biggest * (1 + 1e-9), d
        assert all(k == table.k_min[cls[i], j] for g in draft for mb in g.micro_batches
                   for i, k in mb)


@pytest.mark.parametrize(("batch_time_s", "expected"), [
    (3.0, 3),    # 9 (1 under) beats 12 (2 over, x1.2)
    (3.95, 2),   # 7.9 (2.1 under) beats 11.85 (1.85 over, 2.22 weighted): the penalty decides
    (3.7, 3),    # 11.1 (1.1 over, 1.32 weighted) beats 7.4 (2.6 under)
    (20.0, 1),   # at least one batch
])
def test_dcp_accumulation_count_is_nearest_the_target_with_overshoot_penalised(
        batch_time_s: float, expected: int) -> None:
    assert accumulation_count(batch_time_s, 10.0, available=10) == expected
    assert accumulation_count(batch_time_s, 10.0, available=1) == 1


@pytest.mark.timeout(60)
def test_dcp_greedy_is_seeded_and_keeps_each_group_on_its_bucket_batches() -> None:
    table, _ = _preset_table("video-short", "h200x32", 200)
    digest = [[(g.size, g.first_rank, g.micro_batches) for g in dcp_greedy_draft(table, seed=s) or []]
              for s in (0, 0, 1, 2, 3)]
    assert digest[0] == digest[1]
    assert any(d != digest[0] for d in digest[2:])
    bucket_of = {i: b for b, m in enumerate(shape_buckets(table)) for i in m}
    draft = dcp_greedy_draft(table, seed=0)
    assert draft is not None
    for g in draft:
        for mb in g.micro_batches:  # one bucket and one policy per micro-batch
            assert len({bucket_of[i] for i, _ in mb}) == 1
            assert len({k for _, k in mb}) == 1


def test_naive_deals_sample_i_to_rank_i_mod_n() -> None:
    table = _tiny_table([100, 200, 300, 400, 500, 600])
    draft = naive_draft(table)
    assert draft is not None
    members = {g.first_rank: [i for mb in g.micro_batches for i, _ in mb] for g in draft}
    assert members == {0: [0, 4], 1: [1, 5], 2: [2], 3: [3]}


def test_every_tiny_baseline_is_valid() -> None:
    table = _tiny_table([2400, 1300, 800, 500, 120, 90, 60, 40])
    cm = CostModel(file=table.cost_model.file, cluster=table.cost_model.cluster)
    drafts = baseline_drafts(table, seed=0)
    assert {"static-best", "megatron-dyncp", "dcp-greedy", "bucket-sp4"} <= set(drafts)
    for name, draft in drafts.items():
        plan = assemble_plan(draft, table.samples, cost_model=cm, meta=PlanMeta(
            status="BASELINE", method=name, wall_time_s=0.0,
            lower_bound=LowerBound(value_s=0.0, kind="none")))
        assert validate_plan(plan, table.samples, cost_model=cm) == [], name
