"""Executor parts that need no process group: policies, memory meter, loading, sampler, registry."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from executor.checkpointing import validate_policies
from executor.context import SPContext
from executor.data import PlanBatchSampler, SyntheticDataset
from executor.groups import GroupRegistry
from executor.layout import PackedLayout, SampleShape
from executor.memory import ActivationMeter
from executor.runtime import Executor
from executor.step_gc import StepGC
from tests.executor.helpers import CONFIG, build_model, make_plan, s1d, s2d


def _run(model: torch.nn.Module, ids: torch.Tensor, lengths: list[int], policies: list[int]
         ) -> tuple[float, int, int, list[torch.Tensor]]:
    layout = PackedLayout(samples=tuple(SampleShape(tokens=n) for n in lengths), group_size=1,
                          index_in_group=0)
    model.zero_grad(set_to_none=True)
    with ActivationMeter().ignore_parameters(model) as meter:
        out = model(ids, SPContext(layout=layout, group=None), recompute_layers=policies)
        loss = model.token_losses(out, ids).sum()  # type: ignore[operator]
        kept = meter.current_bytes
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return float(loss.detach()), kept, meter.peak_bytes, grads


def test_checkpoint_policies_trade_memory_not_results() -> None:
    model = build_model("1d")
    lengths = [40, 25]
    ids = torch.randint(CONFIG.vocab, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    L = CONFIG.num_layers
    runs = {k: _run(model, ids, lengths, [k, k]) for k in range(L + 1)}
    mixed = _run(model, ids, lengths, [L, 0])
    for k, (loss, _, _, grads) in [*runs.items(), ("mixed", mixed)]:
        assert loss == pytest.approx(runs[0][0], rel=1e-12), k
        assert max(float((g - r).abs().max()) for g, r in zip(grads, runs[0][3], strict=True)) < 1e-12
    kept = [runs[k][1] for k in range(L + 1)]
    assert all(a > b for a, b in itertools.pairwise(kept)), kept  # more recompute, less kept
    assert runs[L][2] < runs[0][2]  # and a lower peak over forward+backward
    assert runs[L][1] < mixed[1] < runs[0][1]


def test_policy_out_of_range_names_the_sample() -> None:
    with pytest.raises(ValueError, match="sample 1: recompute_layers=5 is outside \\[0, 3\\]"):
        validate_policies([0, 5], num_layers=3, num_samples=2)
    with pytest.raises(ValueError, match="2 checkpoint policies for 3 samples"):
        validate_policies([0, 1], num_layers=3, num_samples=3)


def _one_rank_plan():  # type: ignore[no-untyped-def]
    return make_plan([([0], [[(s1d("a", 5), 0), (s1d("b", 3), 1)], [(s1d("c", 4), 3)]])],
                     num_ranks=1, step=0)


def test_sampler_and_loader_follow_the_plan() -> None:
    plan = _one_rank_plan()
    samples = [s1d("z", 2), s1d("c", 4), s1d("a", 5), s1d("b", 3)]
    data = SyntheticDataset(samples, kind="1d", vocab=CONFIG.vocab)
    sampler = PlanBatchSampler(plan_for_step=lambda step: plan.rank_view(0), steps=[0, 1],
                               index_of=data.index_of)
    assert list(sampler) == [[2, 3], [1], [2, 3], [1]]
    executor = Executor(registry=GroupRegistry(world_size=1, rank=0, group_sizes=[1]))
    loaded = [[data[i] for i in batch] for batch in sampler.indices(plan.rank_view(0))]
    works = list(executor.micro_batches(plan.rank_view(0), loaded=loaded))
    assert [w.sample_ids for w in works] == [("a", "b"), ("c",)]
    assert [w.recompute_layers for w in works] == [(0, 1), (3,)]
    total = sum(float(w.token_weights.sum()) for w in works)
    assert total == pytest.approx(1.0)  # the step's weights sum to one (token mean)
    bad = [[data[data.index_of["b"]], data[data.index_of["a"]]], [data[1]]]
    with pytest.raises(ValueError, match="loaded sample 'b' where the plan has 'a'"):
        list(executor.micro_batches(plan.rank_view(0), loaded=bad))
    with pytest.raises(ValueError, match="loader ended before micro-batch 1"):
        list(executor.micro_batches(plan.rank_view(0), loaded=loaded[:1]))
    with pytest.raises(ValueError, match="'zz' is not in the dataset"):
        PlanBatchSampler(plan_for_step=lambda s: make_plan([([0], [[(s1d("zz", 2), 0)]])],
                                                            num_ranks=1).rank_view(0),
                         steps=[0], index_of=data.index_of).indices(
            make_plan([([0], [[(s1d("zz", 2), 0)]])], num_ranks=1).rank_view(0))


def test_registry_checks_sizes_and_membership() -> None:
    registry = GroupRegistry(world_size=1, rank=0, group_sizes=[1, 2, 4])
    assert registry.sizes == (1,)
    plan = _one_rank_plan()
    assert registry.group_for(plan.groups[0]) is None
    with pytest.raises(ValueError, match="rank=3 is outside the world of 2"):
        GroupRegistry(world_size=2, rank=3, group_sizes=[1])
    with pytest.raises(ValueError, match="not initialised"):
        GroupRegistry(world_size=2, rank=0, group_sizes=[1, 2])
    two = make_plan([([0, 1], [[(s2d("v", 2, 2, 2), 0)]])], num_ranks=2)
    with pytest.raises(ValueError, match="rank 0 is not in planned group|size 2, not one of"):
        registry.group_for(two.groups[0])


def test_dataset_is_deterministic_and_2d_shapes_match() -> None:
    clip = s2d("v", 3, 2, 2)
    a = SyntheticDataset([clip], kind="2d", channels=3, seed=1)[0]
    b = SyntheticDataset([clip], kind="2d", channels=3, seed=1)[0]
    assert torch.equal(a["inputs"], b["inputs"])  # type: ignore[arg-type]
    assert a["inputs"].shape == (12, 3)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="kind must be"):
        SyntheticDataset([clip], kind="4d")


def test_executor_imports_neither_solver_nor_web_framework() -> None:
    import subprocess
    import sys

    code = ("import sys, executor.client, executor.runtime, executor.models, executor.data, "
            "executor.memory\n"
            "bad = [m for m in ('ortools', 'fastapi', 'uvicorn', 'planner.planning', 'planner.epoch', "
            "'scipy', 'api') if m in sys.modules]\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("kind", ["causal_1d", "spatial_2d", "temporal_2d"])
def test_packed_attention_never_crosses_samples(kind: str) -> None:
    from executor.attention import packed_attention

    gen = torch.Generator().manual_seed(1)
    shapes = (SampleShape(tokens=12, frames=3), SampleShape(tokens=8, frames=2))
    q, k, v = (torch.randn(20, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    packed = packed_attention(q, k, v, samples=shapes, kind=kind)  # type: ignore[arg-type]
    first = packed_attention(q[:12], k[:12], v[:12], samples=shapes[:1], kind=kind)  # type: ignore[arg-type]
    assert torch.allclose(packed[:12], first, atol=1e-14, rtol=0)
    k2 = k.clone()
    k2[12:] = torch.randn(8, 2, 4, generator=gen, dtype=torch.float64)  # only the second sample
    again = packed_attention(q, k2, v, samples=shapes, kind=kind)  # type: ignore[arg-type]
    assert torch.equal(again[:12], packed[:12]) and not torch.allclose(again[12:], packed[12:])


def _gc_events_of_a_run(step_gc: StepGC | None) -> list[object]:
    """Four steps of the one-rank plan, each micro-batch making 3,000 reference cycles (past the
    automatic collector's threshold); the order of steps, micro-batches and collections."""
    views = [make_plan([([0], [[(s1d("a", 5), 0), (s1d("b", 3), 1)], [(s1d("c", 4), 3)]])],
                       num_ranks=1, step=step).rank_view(0) for step in range(4)]
    data = SyntheticDataset([s1d("a", 5), s1d("b", 3), s1d("c", 4)], kind="1d", vocab=CONFIG.vocab)
    loaded = [[data[data.index_of[ps.sample.id]] for ps in mb.samples] for mb in views[0].group.micro_batches]
    events: list[object] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            events.append("gc")

    executor = Executor(registry=GroupRegistry(world_size=1, rank=0, group_sizes=[1]), step_gc=step_gc)
    gc.callbacks.append(on_gc)
    try:
        for step, view in enumerate(views):
            executor.begin_step(view, step=step)
            events.append(f"step {step}")
            for work in executor.micro_batches(view, loaded=loaded):
                for _ in range(3000):
                    cycle: list[object] = []
                    cycle.append(cycle)
                events.append(work.sample_ids)
    finally:
        gc.callbacks.remove(on_gc)
    return events


def test_step_gc_collects_at_step_boundaries_and_never_inside_a_micro_batch() -> None:
    assert gc.isenabled()
    # Python's own collector runs inside the micro-batches (what StepGC is for).
    assert "gc" in _gc_events_of_a_run(None)[1:]
    with StepGC(every_steps=2) as step_gc:
        assert not gc.isenabled()
        events = _gc_events_of_a_run(step_gc)
    assert gc.isenabled()  # given back
    mb = [("a", "b"), ("c",)]
    assert events == ["step 0", *mb, "gc", "step 1", *mb, "step 2", *mb, "gc", "step 3", *mb]
    assert step_gc.num_collections == 2 and step_gc.collect_s > 0
    step_gc.at_step_boundary()  # closed: nothing more
    assert step_gc.num_collections == 2


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_step_gc_rejects_a_bad_interval(every: object) -> None:
    with pytest.raises(ValueError, match="every_steps must be a positive integer"):
        StepGC(every_steps=every)  # type: ignore[arg-type]
    assert gc.isenabled()
