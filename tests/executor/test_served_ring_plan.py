"""End to end with rings: an epoch planned by a real ``dcp serve`` with ``layout="auto"`` runs on 4
gloo ranks whose process groups are built from the layouts the epoch declares, and every step
equals the plain single-process step (fp64, <= 1e-10 relative).

The model has 2 query heads, so a group of 4 ranks is past the heads: it runs only as Ulysses x
ring (2 x 2, or a pure ring of 4). The simulated device memory holds about 12 tokens per rank, so
the long samples (up to 51 tokens) need such groups. Each rank fetches its view of each step
(``PlannerClient.rank_plan``) and the whole plan (digest-checked) through the service client, builds
``GroupRegistry.from_layouts(PlannerClient.epoch_layouts(...))``, and runs the step; the test
process recomputes each step in one process without sequence parallelism."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from dcp_cli.net import free_port
from executor.client import PlannerClient, RetryPolicy
from executor.groups import GroupRegistry
from executor.models import Llama1D, init_weights
from executor.runtime import Executor
from planner.layouts import num_process_groups
from tests.executor.helpers import CONFIG, gloo_rank, init_gloo, load_rank_results, reference_backward
from tests.executor.scenarios import run_step
from tests.executor.service import OPTIONS, Service, running_service, start_epoch
from tests.executor.worlds import spawn_world

WORLD = 4
EPOCH = "served-rings"
NUM_SAMPLES, PER_STEP, SEED = 16, 4, 1
TOL = 1e-10
MODEL_CONFIG = dataclasses.replace(CONFIG, num_heads=2)
"""The executor tests' model with 2 query heads (head dim 8): groups of 4 are past the heads."""


def _setup(tokens_per_rank: int = 12) -> tuple[ClusterSpec, CostModelFile]:
    """A 4-rank node whose memory holds about ``tokens_per_rank`` tokens of the model per rank."""
    spec = ModelSpec(name="ref-llama-2heads", kind="1d", num_layers=MODEL_CONFIG.num_layers,
                     hidden=MODEL_CONFIG.hidden, num_heads=MODEL_CONFIG.num_heads,
                     ffn_hidden=MODEL_CONFIG.ffn_hidden, vocab=MODEL_CONFIG.vocab)
    cluster = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": WORLD, "gpus_per_node": WORLD})
    model = CostModel(file=analytic_cost_model(spec, cluster.hardware), cluster=cluster)
    need = model.fixed_bytes() + float(model.activation_bytes(tokens_per_rank, group_size=1))
    hardware = cluster.hardware.model_copy(update={"name": "h200-tight",
                                                   "hbm_bytes": need / cluster.memory_cap_fraction})
    cluster = cluster.model_copy(update={"hardware": hardware, "name": "cpu4-tight"})
    return cluster, analytic_cost_model(spec, hardware)


def _manifest() -> list[Sample]:
    return [Sample(id=f"t{i}", tokens=4 + (i * 37) % 48) for i in range(NUM_SAMPLES)]


def _model() -> torch.nn.Module:
    model = Llama1D(MODEL_CONFIG).to(torch.float64)
    init_weights(model, seed=0)
    return model


def _worker(rank: int, url: str, port: int, num_steps: int, out_dir: str) -> None:
    with (gloo_rank(rank, WORLD, port, out_dir) as results,
          PlannerClient(url, retry=RetryPolicy(deadline_s=30)) as client):
        layouts = client.epoch_layouts(EPOCH)
        assert layouts is not None
        registry = GroupRegistry.from_layouts(world_size=WORLD, rank=rank, layouts=layouts)
        results["num_groups"] = registry.num_groups
        executor = Executor(registry=registry)
        for step in range(num_steps):
            plan, _ = client.step_plan(EPOCH, step)
            view = client.rank_plan(EPOCH, step, rank)
            assert view == plan.rank_view(rank), f"step {step}: the served rank view is not the plan's"
            model = _model()
            run_step(executor, model, plan, "1d")
            results[f"grads_{step}"] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, dict[str, object]]]:
    with running_service(tmp_path_factory.mktemp("served-rings")) as svc:
        cluster, cost_model = _setup()
        status = start_epoch(svc.url, epoch_id=EPOCH, samples=_manifest(), samples_per_step=PER_STEP, seed=SEED,
                             cluster=cluster, cost_model=cost_model, options={**OPTIONS, "layout": "auto"})
        yield svc, status


@pytest.mark.timeout(400)
def test_a_served_auto_epoch_with_rings_equals_the_plain_steps(
        served: tuple[Service, dict[str, object]], tmp_path: Path) -> None:
    svc, status = served
    num_steps = int(status["steps_total"])  # type: ignore[call-overload]
    # 2 heads on a node of 4: sizes 1 and 2 as Ulysses or a ring of 2, 4 as 2 x 2 or a ring of 4
    assert status["layouts"] == [[1, 1, 1], [2, 1, 2], [2, 2, 1], [4, 1, 4], [4, 2, 2]]
    with PlannerClient(svc.url) as client:
        plans = [client.step_plan(EPOCH, step)[0] for step in range(num_steps)]
    rings = [(p.step, g.ulysses_degree, g.ring_degree) for p in plans for g in p.groups if g.ring_degree > 1]
    assert rings, [[(g.size, g.ring_degree) for g in p.groups] for p in plans]
    start = time.perf_counter()
    spawn_world(_worker, args=(svc.url, free_port(), num_steps, str(tmp_path)), nprocs=WORLD)
    results = load_rank_results(tmp_path, WORLD)
    # the registry made exactly the groups the count formula says for the declared layouts
    declared = [tuple(t) for t in status["layouts"]]  # type: ignore[union-attr]
    assert {res["num_groups"] for res in results} == {num_process_groups(WORLD, declared)}  # type: ignore[arg-type]
    for plan in plans:
        model = _model()
        reference_backward(model, plan, "1d")
        want = [p.grad for p in model.parameters()]
        scale = max(float(g.abs().max()) for g in want)  # type: ignore[union-attr]
        assert scale > 1e-3
        for rank, res in enumerate(results):
            got = res[f"grads_{plan.step}"]
            diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale  # type: ignore[operator,union-attr]
            assert diff <= TOL, f"step {plan.step}, rank {rank}: relative diff {diff:.2e}"
    print(f"{num_steps} served steps, ring groups (step, u, r) {rings}, "
          f"{results[0]['num_groups']} process groups, {time.perf_counter() - start:.1f} s in the ranks")


def test_from_layouts_refuses_degrees_that_do_not_multiply_to_the_size() -> None:
    with pytest.raises(ValueError, match=r"layout \[4, 2, 3\] is not \(size, ulysses_degree, ring_degree\)"):
        GroupRegistry.from_layouts(world_size=4, rank=0, layouts=[(1, 1, 1), (4, 2, 3)])


COUNT_LAYOUTS = [(1, 1, 1), (4, 1, 4), (4, 2, 2), (6, 3, 2), (6, 2, 3), (6, 6, 1)]
"""Layouts on 6 ranks whose Ulysses degrees 2 and 3 are not sizes themselves (their subgroups are
new groups), strided rings of stride 2 and 3, a pure ring (contiguous: nothing new)."""


def _count_worker(rank: int, port: int, out_dir: str) -> None:
    init_gloo(rank, 6, port)
    try:
        registry = GroupRegistry.from_layouts(world_size=6, rank=rank, layouts=COUNT_LAYOUTS)
        torch.save({"num_groups": registry.num_groups, "sizes": registry.sizes, "layouts": registry.layouts},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_count_formula_is_the_registrys_real_count(tmp_path: Path) -> None:
    spawn_world(_count_worker, args=(free_port(), str(tmp_path)), nprocs=6)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(6)]
    assert {r["num_groups"] for r in results} == {num_process_groups(6, COUNT_LAYOUTS)}
    # by hand: contiguous 3 of 4 + 1 of 6; rings {a, a+2} a < 4, {a, a+3} a < 3, {a, a+2, a+4} a < 2;
    # Ulysses blocks of 2 at 0..4 (2 x 2 at 0..2, 2 x 3 at 0) and of 3 at 0 and 3 (3 x 2 at 0 only)
    assert num_process_groups(6, COUNT_LAYOUTS) == 4 + 4 + 3 + 2 + 5 + 2
    assert results[0]["sizes"] == (1, 4, 6) and results[0]["layouts"] == ((1, 4), (2, 2), (2, 3), (3, 2))
