"""Planned steps with the chunked loss equal the plain single-process step (fp64, 4 gloo ranks).

Each rank runs the loss over its own sequence shard: ``Llama1D(..., targets=...)`` projects and
takes the cross-entropy ``loss_chunk_tokens`` tokens at a time. The scenarios are the
Ulysses plans of ``tests/executor/scenarios.py`` (groups of 1, 2 and 4, mixed policies, token and
sample normalisation) and the Ulysses x ring plans of ``tests/executor/test_ring_step.py``,
with chunks of 1 and 3 tokens (shards split unevenly) and one longer than any shard; the
world's gradients must equal the plain large-batch step's, whole logits in one process, within
1e-10 relative, and the ranks' loss shares must add up to the whole-logits step's within 1e-10.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dcp_cli.net import free_port
from executor.groups import GroupRegistry
from executor.runtime import Executor
from planner.plan import Plan
from tests.executor import test_ring_step
from tests.executor.helpers import build_model, dataset_for, gloo_rank, load_rank_results, reference_backward
from tests.executor.scenarios import plans_1d
from tests.executor.worlds import spawn_world

WORLD = 4
TOL = 1e-10
CHUNKS = (0, 1, 3, 4096)
"""Loss chunks run; 0: whole logits (the plain cross-entropy of each shard)."""


def _plans() -> dict[str, Plan]:
    ulysses = {f"ulysses{i}": p for i, p in enumerate(plans_1d())}
    return {**ulysses, **test_ring_step.plans(WORLD, "1d")}


def _chunked(chunk: int) -> torch.nn.Module:
    model = build_model("1d")
    model.config = dataclasses.replace(model.config, loss_chunk_tokens=chunk)
    return model


def _step(executor: Executor, model: torch.nn.Module, plan: Plan) -> float:
    rank_plan = plan.rank_view(executor.rank)
    executor.begin_step(rank_plan, step=plan.step or 0)
    data = dataset_for(plan, "1d")
    share = 0.0
    for work in executor.micro_batches(rank_plan, load_sample=data.load):
        losses = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers, targets=work.targets)
        loss = work.loss(losses)
        loss.backward()
        share += float(loss.detach())
    executor.sync_gradients(model)
    return share


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4],
                                 layouts=test_ring_step.LAYOUTS[WORLD])
        executor = Executor(registry=registry)
        for name, plan in _plans().items():
            for chunk in CHUNKS:
                model = _chunked(chunk)
                results[f"loss_{name}_{chunk}"] = _step(executor, model, plan)
                results[f"grad_{name}_{chunk}"] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp("chunked_loss"))
    spawn_world(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    return load_rank_results(out, WORLD)


def test_chunked_loss_steps_equal_the_plain_step(world: list[dict[str, object]]) -> None:
    for name, plan in _plans().items():
        reference = build_model("1d")
        reference_backward(reference, plan, "1d")
        expected = [p.grad for p in reference.parameters()]
        for chunk in CHUNKS:
            for r in range(WORLD):  # after the world sum every rank holds the step's gradient
                got = world[r][f"grad_{name}_{chunk}"]
                assert isinstance(got, list)
                for g, e in zip(got, expected, strict=True):
                    assert e is not None
                    err = float((g - e).abs().max()) / max(float(e.abs().max()), 1e-30)
                    assert err <= TOL, (name, chunk, r, err)


def test_the_ranks_shares_add_up_to_the_step_loss(world: list[dict[str, object]]) -> None:
    for name in _plans():
        whole = sum(float(world[r][f"loss_{name}_0"]) for r in range(WORLD))  # type: ignore[arg-type]
        for chunk in CHUNKS[1:]:
            total = sum(float(world[r][f"loss_{name}_{chunk}"]) for r in range(WORLD))  # type: ignore[arg-type]
            assert abs(total - whole) <= TOL * abs(whole), (name, chunk)
