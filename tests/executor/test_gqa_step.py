"""Grouped-query attention past the key/value heads: a planned step on 4 gloo ranks is still the
plain step (fp64, <= 1e-10 relative).

The reference models get 4 query heads over 2 (or 1) key/value heads. Groups of 2 split 2
key/value heads; groups of 4 are past them, so Ulysses gives each rank the key/value head its
query heads use, replicated (:func:`executor.ulysses.qkv_seq_to_head`). The world-4 runs are
those of ``scenarios.worker`` (``scenarios.GQA_CASES``: the 1D plans with groups 2+1+1, 4 and
1+2+1, the video plans for the 3D DiT; uneven shards, samples shorter than their group, packed
micro-batches, mixed checkpoint policies, both normalisers), spawned once per session. References:
the naive model written from the definitions (``tests/executor/naive_reference.py``, query head
``i`` with key/value head ``i // (H / H_kv)``), and the executor's model on one rank. One plan is
the planner's own (``scenarios.planned_gqa_plan``), with a group past the key/value head.
"""

from __future__ import annotations

import functools

import pytest
import torch

from executor.layout import PackedLayout, SampleShape
from executor.models import ModelConfig
from executor.ulysses import check_kv_heads, qkv_seq_to_head
from planner.plan import Plan
from tests.executor import scenarios
from tests.executor.helpers import CONFIG, build_model, dataset_for, reference_backward
from tests.executor.naive_reference import NaiveSample, step_gradients

REL_TOL = 1e-10


@functools.cache
def _naive(kind: str, kv_heads: int, index: int) -> tuple[float, dict[str, torch.Tensor]]:
    plan = scenarios.gqa_plan(kind, index)
    model = build_model(kind, kv_heads=kv_heads)
    data = dataset_for(plan, kind)
    naive = []
    for ps in (ps for g in plan.groups for mb in g.micro_batches for ps in mb.samples):
        item = data.load(ps.sample)
        naive.append(NaiveSample(inputs=item["inputs"], targets=item["targets"],  # type: ignore[arg-type]
                                 frames=ps.sample.num_frames))
    return step_gradients(dict(model.named_parameters()), naive, kind=kind, normalizer=plan.loss_normalizer.kind,
                          num_layers=CONFIG.num_layers, num_heads=CONFIG.num_heads, num_kv_heads=kv_heads)


def _worst_relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 1e-3, "a real gradient, not zeros"
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "kv_heads", "index"), scenarios.GQA_CASES)
def test_step_past_the_key_value_heads_equals_the_naive_model(world4_results: list[dict[str, object]], kind: str,
                                                              kv_heads: int, index: int) -> None:
    loss, grads = _naive(kind, kv_heads, index)
    model = build_model(kind, kv_heads=kv_heads)
    names = [name for name, _ in model.named_parameters()]
    assert any(model.get_parameter(n).shape[0] == (4 + 2 * kv_heads) * CONFIG.hidden // 4
               for n in names if n.endswith("attn.qkv.weight"))  # the model is grouped-query
    shares = [float(res[f"loss_{kind}_kv{kv_heads}_{index}"]) for res in world4_results]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=REL_TOL)
    want = [grads[n] for n in names]
    for r, res in enumerate(world4_results):
        worst = _worst_relative(res[f"grad_{kind}_kv{kv_heads}_{index}"], want)  # type: ignore[arg-type]
        assert worst <= REL_TOL, f"rank {r}: relative gradient diff {worst:.2e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "kv_heads", "index"), [("1d", 2, 1), ("3d", 1, 1)])
def test_step_past_the_key_value_heads_equals_one_rank(world4_results: list[dict[str, object]], kind: str,
                                                       kv_heads: int, index: int) -> None:
    model = build_model(kind, kv_heads=kv_heads)
    reference_backward(model, scenarios.gqa_plan(kind, index), kind)
    want = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    for r, res in enumerate(world4_results):
        worst = _worst_relative(res[f"grad_{kind}_kv{kv_heads}_{index}"], want)  # type: ignore[arg-type]
        assert worst <= REL_TOL, f"rank {r}: relative gradient diff {worst:.2e}"


@pytest.mark.timeout(300)
def test_a_planner_made_plan_past_the_key_value_head_runs_exactly(world4_results: list[dict[str, object]]) -> None:
    """The planner puts the 40-token sample on a group past the model's one key/value head (memory
    holds it nowhere else); the executor runs the plan as planned and equals the naive model."""
    plan = Plan.model_validate_json(str(world4_results[0]["plan_planned_gqa"]))
    sizes = {ps.sample.id: g.size for g in plan.groups for mb in g.micro_batches for ps in mb.samples}
    assert sizes["long"] >= 2 and len(sizes) == 6  # past the key/value head; every sample planned
    data = dataset_for(plan, "1d")
    naive = [NaiveSample(inputs=item["inputs"], targets=item["targets"])  # type: ignore[arg-type]
             for item in (data.load(ps.sample) for g in plan.groups for mb in g.micro_batches for ps in mb.samples)]
    loss, grads = step_gradients(dict(build_model("1d", kv_heads=1).named_parameters()), naive, kind="1d",
                                 normalizer=plan.loss_normalizer.kind, num_layers=CONFIG.num_layers,
                                 num_heads=CONFIG.num_heads, num_kv_heads=1)
    shares = [float(res["loss_planned_gqa"]) for res in world4_results]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=REL_TOL)
    want = list(grads.values())
    for r, res in enumerate(world4_results):
        worst = _worst_relative(res["grad_planned_gqa"], want)  # type: ignore[arg-type]
        assert worst <= REL_TOL, f"rank {r}: relative gradient diff {worst:.2e}"


def test_one_rank_keeps_each_query_head_with_its_key_value_head() -> None:
    """A group of one: the query heads come back in order, the key/value heads once each (query
    head ``j`` uses ``j // rep``, the grouped-query form of ``packed_attention``)."""
    tokens, kv_heads, rep, head_dim = 5, 2, 3, 4
    qkv = torch.randn(tokens, kv_heads, rep + 2, head_dim, dtype=torch.float64)
    layout = PackedLayout(samples=(SampleShape(tokens=tokens),), group_size=1, index_in_group=0)
    q, k, v = qkv_seq_to_head(qkv, layout, None)
    assert q.shape == (tokens, kv_heads * rep, head_dim)
    assert k.shape == v.shape == (tokens, kv_heads, head_dim)  # not copied per query head
    for head in range(kv_heads * rep):
        assert torch.equal(q[:, head], qkv[:, head // rep, head % rep])
    assert torch.equal(k, qkv[:, :, rep]) and torch.equal(v, qkv[:, :, rep + 1])


def test_sizes_that_do_not_split_the_heads_are_refused() -> None:
    check_kv_heads(num_heads=8, num_kv_heads=2, group_size=4)  # past the key/value heads: allowed
    check_kv_heads(num_heads=8, num_kv_heads=2, group_size=8)
    with pytest.raises(ValueError, match="a group of 3 cannot split num_heads=12, num_kv_heads=4"):
        check_kv_heads(num_heads=12, num_kv_heads=4, group_size=3)  # divides the queries, not the kv heads
    with pytest.raises(ValueError, match="a group of 16"):
        check_kv_heads(num_heads=8, num_kv_heads=2, group_size=16)  # past the query heads
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        check_kv_heads(num_heads=8, num_kv_heads=3, group_size=1)
    with pytest.raises(ValueError, match="num_kv_heads=3 must be positive and divide num_heads=4"):
        ModelConfig(num_heads=4, num_kv_heads=3)
