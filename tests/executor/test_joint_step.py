"""MMDiT-style joint text attention under Ulysses: a planned step on 2 and 4 gloo ranks is the plain step.

``executor.joint.JointDiT3D`` (2 text tokens per sample joining each clip's self-attention, a text
stream with its own projections and MLP, whole on every rank of a group, the last block
context-pre-only) runs:

- world 4: the video plans of ``scenarios.worker`` (groups 2+1+1 and 4, uneven shards, clips
  shorter than the group, packed micro-batches, mixed per-sample checkpoint policies, token
  normalisation), multi-head and with grouped-query attention past the key/value heads
  (``scenarios.JOINT_CASES``), spawned once per session with the other executor scenarios;
- world 2 (its own spawn, :func:`_worker2`): one group of 2 with mixed policies inside a
  micro-batch and a 1-token clip, then groups 1+1 under sample normalisation, multi-head and past
  one key/value head; and the same model wrapped in ``DistributedDataParallel`` (``DDPSync``),
  which needs every parameter used (no text output or MLP left dangling in the last block).

Reference: the naive model written from the definitions (``tests/executor/naive_reference.py``,
``joint_dit3d_prediction``), fp64, <= 1e-10 relative; and the executor's model on one rank.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

from dcp_cli.net import free_port
from executor.context import SPContext
from executor.grad_sync import DDPSync
from executor.groups import GroupRegistry
from executor.joint import JointDiT3D, JointDiT3DBlock, joint_attention
from executor.layout import PackedLayout, SampleShape
from executor.models import ModelConfig
from executor.ring_layout import RingLayout
from executor.runtime import Executor
from planner.plan import Plan
from tests.executor import scenarios
from tests.executor.helpers import (
    CONFIG,
    JOINT_TEXT_TOKENS,
    build_model,
    dataset_for,
    gloo_rank,
    load_rank_results,
    make_plan,
    reference_backward,
    s2d,
)
from tests.executor.naive_reference import NaiveSample, step_gradients
from tests.executor.sync_scenarios import idle_item
from tests.executor.worlds import spawn_world

REL_TOL = 1e-10
L = CONFIG.num_layers


def plans_world2() -> list[Plan]:
    """A group of 2 (mixed policies inside a micro-batch, a 1-token clip, uneven shards), then 1+1."""
    a = make_plan([
        ([0, 1], [[(s2d("P", 3, 1, 3), 0), (s2d("Q", 1, 1, 1), L), (s2d("R", 2, 2, 1), 1)],
                  [(s2d("S", 1, 3, 3), 2)]]),
    ], num_ranks=2, step=0)
    b = make_plan([
        ([0], [[(s2d("T", 2, 1, 3), L)], [(s2d("U", 1, 2, 2), 0)]]),
        ([1], [[(s2d("V", 3, 1, 1), 1), (s2d("W", 1, 1, 5), 0)]]),
    ], num_ranks=2, step=1, normalizer="samples")
    return [a, b]


WORLD2_CASES = [(4, 0), (4, 1), (1, 0), (1, 1)]
"""(key/value heads, plan index) of the world-2 run: multi-head, then 1 key/value head (past it on 2)."""


def _worker2(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, 2, port, out_dir) as results:
        registry = GroupRegistry(world_size=2, rank=rank, group_sizes=[1, 2])
        executor = Executor(registry=registry)
        for kv_heads, i in WORLD2_CASES:
            model = build_model("3d_joint", kv_heads=kv_heads)
            results[f"loss_kv{kv_heads}_{i}"] = scenarios.run_step(executor, model, plans_world2()[i], "3d_joint")
            results[f"grad_kv{kv_heads}_{i}"] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        ddp = nn.parallel.DistributedDataParallel(build_model("3d_joint"), forward_sync_buffers=False)
        executor = Executor(registry=registry, grad_sync=DDPSync(ddp, idle_item=idle_item("3d")))
        plan = plans_world2()[0]
        rank_plan = plan.rank_view(rank)
        executor.begin_step(rank_plan, step=0)
        data = dataset_for(plan, "3d_joint")
        for work in executor.micro_batches(rank_plan, load_sample=data.load):
            out = ddp(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
            work.loss(JointDiT3D.token_losses(out, work.targets)).backward()
        executor.sync_gradients(ddp)
        results["grad_ddp"] = [p.grad.detach().clone() for p in ddp.parameters()]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def world2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Every rank's results of :func:`_worker2` on a gloo world of 2."""
    out = tmp_path_factory.mktemp("joint_world2")
    spawn_world(_worker2, args=(free_port(), str(out)), nprocs=2)
    loaded = load_rank_results(out, 2)
    return loaded


@functools.cache
def _naive(plan_json: str, kv_heads: int) -> tuple[float, dict[str, torch.Tensor]]:
    plan = Plan.model_validate_json(plan_json)
    data = dataset_for(plan, "3d_joint")
    naive = []
    for ps in (ps for g in plan.groups for mb in g.micro_batches for ps in mb.samples):
        item = data.load(ps.sample)
        naive.append(NaiveSample(inputs=item["inputs"], targets=item["targets"],  # type: ignore[arg-type]
                                 frames=ps.sample.num_frames))
    params = dict(build_model("3d_joint", kv_heads=kv_heads).named_parameters())
    return step_gradients(params, naive, kind="3d_joint", normalizer=plan.loss_normalizer.kind,
                          num_layers=CONFIG.num_layers, num_heads=CONFIG.num_heads, num_kv_heads=kv_heads)


def _check(results: list[dict[str, object]], plan: Plan, kv_heads: int, key: str) -> None:
    loss, grads = _naive(plan.model_dump_json(), kv_heads)
    names = [name for name, _ in build_model("3d_joint", kv_heads=kv_heads).named_parameters()]
    assert float(grads["text"].abs().max()) > 1e-3  # the text stream is trained
    assert float(grads["layers.0.attn.text_out.weight"].abs().max()) > 1e-3  # the text's own queries matter
    assert float(grads[f"layers.{L - 1}.attn.text_qkv.weight"].abs().max()) > 1e-3  # last block: text keys
    shares = [float(res[f"loss_{key}"]) for res in results]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=REL_TOL)
    scale = max(float(g.abs().max()) for g in grads.values())
    for r, res in enumerate(results):
        got = res[f"grad_{key}"]
        assert isinstance(got, list) and len(got) == len(names)
        for name, g in zip(names, got, strict=True):
            diff = float((g - grads[name]).abs().max()) / scale
            assert diff <= REL_TOL, f"rank {r}: {name} relative diff {diff:.2e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kv_heads", "index"), scenarios.JOINT_CASES)
def test_joint_attention_step_on_4_ranks_equals_the_naive_model(world4_results: list[dict[str, object]],
                                                                kv_heads: int, index: int) -> None:
    _check(world4_results, scenarios.plans_2d()[index], kv_heads, f"3d_joint_kv{kv_heads}_{index}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kv_heads", "index"), WORLD2_CASES)
def test_joint_attention_step_on_2_ranks_equals_the_naive_model(world2_results: list[dict[str, object]],
                                                                kv_heads: int, index: int) -> None:
    _check(world2_results, plans_world2()[index], kv_heads, f"kv{kv_heads}_{index}")


@pytest.mark.timeout(300)
def test_joint_attention_under_ddp_uses_every_parameter(world2_results: list[dict[str, object]]) -> None:
    model = build_model("3d_joint")
    reference_backward(model, plans_world2()[0], "3d_joint")
    want = [p.grad.detach() for p in model.parameters()]  # type: ignore[union-attr]
    scale = max(float(w.abs().max()) for w in want)
    for r, res in enumerate(world2_results):
        got = res["grad_ddp"]
        assert isinstance(got, list) and len(got) == len(want)
        worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale
        assert worst <= REL_TOL, f"rank {r}: relative gradient diff {worst:.2e}"


def test_one_rank_joint_model_equals_the_naive_model() -> None:
    plan = plans_world2()[1]
    model = build_model("3d_joint", kv_heads=2)
    reference_backward(model, plan, "3d_joint")
    _, grads = _naive(plan.model_dump_json(), 2)
    scale = max(float(g.abs().max()) for g in grads.values())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert float((p.grad - grads[name]).abs().max()) / scale <= REL_TOL, name


def test_the_last_block_is_context_pre_only() -> None:
    model = build_model("3d_joint")
    names = {name for name, _ in model.named_parameters()}
    assert "layers.0.text_mlp.0.weight" in names and "layers.0.attn.text_out.weight" in names
    last = f"layers.{L - 1}."
    assert {last + "attn.text_qkv.weight", last + "text_attn_norm.weight"} <= names
    assert not any(n.startswith((last + "text_mlp", last + "attn.text_out")) for n in names)


def test_joint_model_needs_text_tokens() -> None:
    with pytest.raises(ValueError, match="joint_text_tokens > 0, got 0"):
        JointDiT3D(ModelConfig())
    with pytest.raises(ValueError, match="joint_text_tokens must be >= 0, got -1"):
        ModelConfig(joint_text_tokens=-1)


def test_joint_attention_refuses_text_rows_that_do_not_match_the_samples() -> None:
    layout = PackedLayout(samples=(SampleShape(tokens=4, frames=2), SampleShape(tokens=3)), group_size=1,
                          index_in_group=0)
    ctx = SPContext(layout=layout, group=None)
    clip = torch.zeros(7, 4, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="3 text rows for 2 samples of 2 text tokens"):
        joint_attention(clip, torch.zeros(3, 4, 3, 4, dtype=torch.float64), ctx, text_tokens=JOINT_TEXT_TOKENS)
    block = JointDiT3DBlock(dataclasses.replace(CONFIG, joint_text_tokens=JOINT_TEXT_TOKENS))
    with pytest.raises(ValueError, match="joint block: 8 rows, expected 7 local clip tokens"):
        block(torch.zeros(8, CONFIG.hidden), ctx)


def test_joint_attention_refuses_a_ring() -> None:
    ring = RingLayout(samples=(SampleShape(tokens=4, frames=1),), ulysses_degree=1, ring_degree=1, index_in_group=0)
    ctx = SPContext(layout=ring.ulysses_layout(), group=None, ring=ring)
    with pytest.raises(ValueError, match="pure Ulysses groups only"):
        joint_attention(torch.zeros(4, 4, 3, 4), torch.zeros(2, 4, 3, 4), ctx, text_tokens=JOINT_TEXT_TOKENS)
