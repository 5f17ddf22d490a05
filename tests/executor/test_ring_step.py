"""A planned step with Ulysses x ring groups equals the plain single-process step (fp64).

Plans carry ``ring_degree`` per group (``planner/plan.py``); the executor builds the zig-zag
layouts and the Ulysses and ring subgroups (``executor/ring_layout.py``, ``executor/groups.py``).
World of 4: 1 x 2 beside a pure-Ulysses pair, 2 x 2, 1 x 4, on the causal 1D model (Llama1D), the
non-causal 3D model (DiT3D, full_3d) and GQA with fewer key/value heads than the Ulysses degree;
packed micro-batches with mixed checkpoint policies. World of 8 (``slow``): 4 x 2 beside a mixed
plan. One spawn per world runs every case; gradients after the world sum must equal the
reference's within 1e-10 relative."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dcp_cli.net import free_port
from executor.groups import GroupRegistry
from executor.runtime import Executor
from planner.plan import GroupPlan, Plan
from tests.executor.helpers import (
    CONFIG,
    build_model,
    gloo_rank,
    load_rank_results,
    make_plan,
    reference_backward,
    s1d,
    s2d,
)
from tests.executor.scenarios import run_step
from tests.executor.worlds import spawn_world

L = CONFIG.num_layers
TOL = 1e-10


def _with_rings(plan: Plan, degrees: list[int]) -> Plan:
    groups = [GroupPlan.model_validate({**g.model_dump(), "ring_degree": r}) for g, r in zip(plan.groups, degrees,
                                                                                               strict=True)]
    return Plan.model_validate({**plan.model_dump(), "groups": [g.model_dump() for g in groups]})


def plans(world: int, kind: str) -> dict[str, Plan]:
    """The cases of one world and model kind, by name."""
    s = s1d if kind == "1d" else (lambda i, t: s2d(i, 1 if t % 2 else 2, 1, t if t % 2 else t // 2))
    if world == 4:
        return {
            "1x2+ulysses2": _with_rings(make_plan([
                ([0, 1], [[(s("a", 7), 0), (s("b", 9), L)], [(s("c", 5), 1)]]),
                ([2, 3], [[(s("d", 6), 2), (s("e", 3), 0)]]),
            ], num_ranks=4, step=0), [2, 1]),
            "2x2": _with_rings(make_plan([
                ([0, 1, 2, 3], [[(s("f", 11), 1), (s("g", 4), 0), (s("h", 6), L)], [(s("i", 13), 0)]]),
            ], num_ranks=4, step=1), [2]),
            "1x4": _with_rings(make_plan([
                ([0, 1, 2, 3], [[(s("j", 17), 2), (s("k", 8), 0)], [(s("l", 9), L), (s("m", 12), 1)]]),
            ], num_ranks=4, step=2, normalizer="samples"), [4]),
        }
    return {
        "4x2": _with_rings(make_plan([
            ([0, 1, 2, 3, 4, 5, 6, 7], [[(s("a", 19), 1), (s("b", 4), 0), (s("c", 9), L)], [(s("d", 23), 0)]]),
        ], num_ranks=8, step=0), [2]),
        "2x2+1x2+1+1": _with_rings(make_plan([
            ([0, 1, 2, 3], [[(s("e", 10), 2), (s("f", 7), 0)]]),
            ([4, 5], [[(s("g", 6), L)], [(s("h", 5), 0), (s("i", 4), 1)]]),
            ([6], [[(s("j", 3), 0)]]),
            ([7], []),
        ], num_ranks=8, step=1), [2, 2, 1, 1]),
    }


CASES = {4: [("1d", None), ("3d", None), ("1d", 1), ("1d", 2)], 8: [("1d", None), ("3d", None), ("1d", 2)]}
"""(model kind, key/value heads) of each world: GQA with 1 key/value head under Ulysses degree 2
and with 2 under Ulysses degree 4 replicates heads; with 2 under degree 2 it splits them."""
LAYOUTS = {4: [(1, 2), (2, 2), (1, 4)], 8: [(4, 2), (2, 2), (1, 2)]}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port, out_dir) as results:
        start = time.perf_counter()
        registry = GroupRegistry(world_size=world, rank=rank, group_sizes=[1, 2, 4, 8], layouts=LAYOUTS[world])
        results["num_groups"] = (registry.num_groups, registry.num_ring_groups)
        executor = Executor(registry=registry)
        for kind, kv in CASES[world]:
            for name, plan in plans(world, kind).items():
                model = build_model(kind, kv_heads=kv)
                run_step(executor, model, plan, kind)
                results[f"{kind}_kv{kv}_{name}"] = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        if world == 4:
            # A layout the registry was not given: every rank refuses before any collective.
            narrow = Executor(registry=GroupRegistry(world_size=4, rank=rank, group_sizes=[1, 2, 4], layouts=[(2, 2)]))
            try:
                narrow.begin_step(plans(4, "1d")["1x4"].rank_view(rank), step=2)
                results["unregistered"] = None
            except ValueError as err:
                results["unregistered"] = str(err)
            # A sample too short for the ring's chunks: the ranks of its group name it.
            short = _with_rings(make_plan([([0, 1, 2, 3], [[(s1d("x", 20), 0), (s1d("y", 5), 0)]])],
                                          num_ranks=4, step=3), [4])
            executor.begin_step(short.rank_view(rank), step=3)
            try:
                list(executor.micro_batches(short.rank_view(rank), load_sample=lambda s: {}))
                results["short"] = None
            except ValueError as err:
                results["short"] = str(err)
        results["wall_s"] = time.perf_counter() - start


def _spawn(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp(f"ring{world}"))
    spawn_world(_worker, args=(world, free_port(), str(out)), nprocs=world)
    loaded = load_rank_results(out, world)
    return loaded


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return _spawn(4, tmp_path_factory)


@pytest.fixture(scope="module")
def world8(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return _spawn(8, tmp_path_factory)


def _check(results: list[dict[str, object]], world: int) -> None:
    for kind, kv in CASES[world]:
        for name, plan in plans(world, kind).items():
            model = build_model(kind, kv_heads=kv)
            reference_backward(model, plan, kind)
            want = [p.grad for p in model.parameters()]
            scale = max(float(g.abs().max()) for g in want)  # type: ignore[union-attr]
            assert scale > 1e-3
            for rank, res in enumerate(results):
                got = res[f"{kind}_kv{kv}_{name}"]
                assert isinstance(got, list)
                diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale  # type: ignore[operator]
                assert diff <= TOL, f"rank {rank}, {kind} kv={kv}, {name}: relative diff {diff:.2e}"


@pytest.mark.timeout(300)
def test_ring_steps_equal_the_plain_step_on_4_ranks(world4: list[dict[str, object]]) -> None:
    _check(world4, 4)


@pytest.mark.timeout(300)
def test_registry_creates_a_counted_set_of_ring_subgroups(world4: list[dict[str, object]]) -> None:
    # contiguous: 3 pairs + 1 group of 4; layouts 1x2 and 1x4 reuse them, 2x2 adds rings {0,2}, {1,3}
    assert {res["num_groups"] for res in world4} == {(6, 2)}
    for res in world4:
        assert "has ring_degree=4, not one of the registered layouts (ulysses_degree, ring_degree) [(2, 2)]" in str(
            res["unregistered"])
        assert "group of ranks 0..3, micro-batch 0: sample 1 has 5 tokens, fewer than the 8 chunks" in str(
            res["short"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ring_steps_equal_the_plain_step_on_8_ranks(world8: list[dict[str, object]]) -> None:
    # contiguous 7 + 5 + 1; 4x2 adds 4 rings, 2x2 adds the 6 rings {f, f+2}
    assert {res["num_groups"] for res in world8} == {(23, 10)}
    _check(world8, 8)
    print(f"8 ranks: {max(float(res['wall_s']) for res in world8):.1f} s in the ranks")  # type: ignore[arg-type]


ISSUE_MATRIX = {(u, r, case) for u, r in ((1, 2), (2, 2), (1, 4), (4, 2)) for case in ("1d causal", "3d", "gqa")}
"""Issue 25's exactness matrix: each layout on the causal 1D model, the non-causal 3D model and
GQA, every ring group with packed samples of different lengths and mixed checkpoint policies."""


def test_the_cases_cover_the_issue_matrix() -> None:
    """The spawned cases above (not a separate run) hold every cell of :data:`ISSUE_MATRIX`."""
    covered: set[tuple[int, int, str]] = set()
    policies_of: dict[tuple[int, int], set[int]] = {}
    for world, cases in CASES.items():
        for kind, kv in cases:
            case = "gqa" if kv is not None else ("1d causal" if kind == "1d" else "3d")
            for name, plan in plans(world, kind).items():
                for group in plan.groups:
                    if group.ring_degree == 1:
                        continue
                    u, r = group.ulysses_degree, group.ring_degree
                    assert (u, r) in LAYOUTS[world], (world, name, u, r)
                    policies = {s.recompute_layers for mb in group.micro_batches for s in mb.samples}
                    assert len(policies) >= 2, (world, name, policies)  # mixed inside the group
                    policies_of.setdefault((u, r), set()).update(policies)
                    assert any(len({s.sample.tokens for s in mb.samples}) >= 2 for mb in group.micro_batches), (
                        world, name)  # packed, uneven lengths: the per-sample masks matter
                    covered.add((u, r, case))
    assert covered >= ISSUE_MATRIX, sorted(ISSUE_MATRIX - covered)
    for layout, policies in policies_of.items():  # none, full and selective on every layout
        assert {0, L} <= policies and policies - {0, L}, (layout, policies)
