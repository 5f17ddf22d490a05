"""The cost model counts the collectives the executor really issues: calls and bytes per
micro-batch (1D and 2D, uneven shards, samples shorter than the group, mixed policies), and the
one gradient all-reduce per step."""

from __future__ import annotations

import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_hardware
from costmodel.specs import ClusterSpec, ModelSpec
from dcp_cli.net import free_port
from tests.executor import collectives
from tests.executor.helpers import CONFIG, load_rank_results
from tests.executor.scenarios import WORLD, plans_1d, plans_2d
from tests.executor.worlds import spawn_world

FP32_OVER_BF16 = 2  # the analytic file counts bf16 bytes; the test runs fp32


def _cost_model(kind: str) -> CostModel:
    spec = ModelSpec(name=f"ref-{kind}", kind=kind, num_layers=CONFIG.num_layers,  # type: ignore[arg-type]
                     hidden=CONFIG.hidden, num_heads=CONFIG.num_heads, ffn_hidden=CONFIG.ffn_hidden,
                     vocab=CONFIG.vocab if kind == "1d" else 0, causal=kind == "1d")
    hardware = load_hardware("h200-sxm")
    cluster = ClusterSpec(name="cpu4", hardware=hardware, num_gpus=WORLD, gpus_per_node=WORLD)
    return CostModel(file=analytic_cost_model(spec, hardware), cluster=cluster)


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("collectives")
    spawn_world(collectives.worker, args=(free_port(), str(out)), nprocs=WORLD)
    loaded = load_rank_results(out, WORLD)
    return loaded


CASES = [("1d", i) for i in range(len(plans_1d()))] + [("2d", i) for i in range(len(plans_2d()))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "index"), CASES)
def test_alltoall_calls_and_bytes_match_the_cost_model(counts: list[dict[str, object]], kind: str,
                                                       index: int) -> None:
    plan = (plans_1d() if kind == "1d" else plans_2d())[index]
    cm = _cost_model(kind)
    comm = cm.file.comm
    layers = cm.num_layers
    checked = 0
    for group in plan.groups:
        for m, mb in enumerate(group.micro_batches):
            ks = [ps.recompute_layers for ps in mb.samples]
            calls, recompute_calls = cm.layer_calls(ks)
            expected_calls = 0 if group.size == 1 else comm.alltoall_ops_per_layer * (2 * calls + recompute_calls)
            # bytes each rank holds, summed over the operations; a group's ranks share the tokens
            # unevenly, so the cost model's s/d per rank is the group's mean
            expected_bytes = 0.0 if group.size == 1 else sum(
                comm.alltoall_bytes_per_token_layer * FP32_OVER_BF16 * ps.sample.tokens / group.size
                * (2 * layers + ps.recompute_layers) for ps in mb.samples)
            measured = [counts[r][f"{kind}_{index}_mb"][m] for r in group.ranks]  # type: ignore[index]
            for rank, (a2a_calls, _, ar_calls, _) in zip(group.ranks, measured, strict=True):
                assert a2a_calls == expected_calls, (rank, m, ks)
                assert ar_calls == 0
            mean_bytes = sum(b for _, b, _, _ in measured) / group.size
            assert mean_bytes == pytest.approx(expected_bytes, rel=1e-12), (group.ranks, m)
            checked += 1
    assert checked == sum(len(g.micro_batches) for g in plan.groups)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "index"), CASES)
def test_one_gradient_allreduce_per_step(counts: list[dict[str, object]], kind: str, index: int) -> None:
    cm = _cost_model(kind)
    for res in counts:
        a2a_calls, _, ar_calls, ar_bytes = res[f"{kind}_{index}_sync"]  # type: ignore[misc]
        assert (a2a_calls, ar_calls) == (0, 1)
        params = res[f"{kind}_{index}_params"]
        assert ar_bytes == params * 4  # every fp32 gradient once
        if kind == "1d":  # the analytic parameter count is the reference 1D model's exactly
            assert cm.file.num_params == params
            assert cm.file.num_params * cm.file.comm.grad_bytes_per_param * 2 == ar_bytes
