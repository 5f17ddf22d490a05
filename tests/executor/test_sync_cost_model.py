"""The cost model prices the gradient sync the executor runs under DDP and FSDP2: the calls and
bytes of each collective, counted on gloo world 4 in the third of three steps (DDP has rebuilt
its buckets by then), and each rank's model-state bytes (unique storages of parameters, gradients,
optimizer states and DDP's bucket buffers).

dtype mapping: the run is fp32; the cost model counts bf16 parameters and gradients and fp32
master weights and Adam moments. fp32 collectives and working copies are FP32_OVER_BF16 times
the bf16 ones; the fp32 optimizer states are as counted, but where the parameters are replicated
(DDP) the fp32 parameter is its own master (no separate copy), while under FSDP2 the sharded
fp32 parameters are the masters beside the unsharded working copies.
"""

from __future__ import annotations

import pytest
import torch

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_hardware
from costmodel.specs import DDP_DEFAULT_BUCKET_BYTES, ClusterSpec, ModelSpec
from dcp_cli.net import free_port
from tests.executor import sync_counts
from tests.executor.helpers import CONFIG, build_model, load_rank_results
from tests.executor.scenarios import WORLD
from tests.executor.worlds import spawn_world

FP32_OVER_BF16 = 2  # the analytic file counts bf16 bytes; the test runs fp32
FP32_GRAD_BYTES = sum(p.numel() * 4 for p in build_model("1d", dtype=torch.float32).parameters())
# DDP's default cap (25 MiB: one bucket here) and a cap of about a fifth of the gradients, an even
# byte count (the cost model's bf16 cap is half of it): 5 buckets, where ceil(G / cap) would be 6
# (each bucket closes past its cap). Also checked by hand at a half and a third: 2 and 3.
DDP_BUCKETS: dict[float | None, int] = {None: 1, (FP32_GRAD_BYTES // 5 + 1) // 2 * 2 / 2**20: 5}
DDP_CAPS_MB = list(DDP_BUCKETS)


def _cost_model(**cluster: object) -> CostModel:
    spec = ModelSpec(name="ref-1d", kind="1d", num_layers=CONFIG.num_layers, hidden=CONFIG.hidden,
                     num_heads=CONFIG.num_heads, ffn_hidden=CONFIG.ffn_hidden, vocab=CONFIG.vocab)
    hardware = load_hardware("h200-sxm")
    spec_cluster = ClusterSpec(name="cpu4", hardware=hardware, num_gpus=WORLD, gpus_per_node=WORLD,
                               **cluster)  # type: ignore[arg-type]
    return CostModel(file=analytic_cost_model(spec, hardware), cluster=spec_cluster)


def _fp32_state_bytes(cm: CostModel, *, sharded_params: bool) -> float:
    state = cm.model_state()
    master = 0.0 if not sharded_params else state.master_bytes
    return FP32_OVER_BF16 * (state.params_bytes + state.grads_bytes) + state.fp32_state_bytes \
        - state.master_bytes + master


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = tmp_path_factory.mktemp("sync_counts")
    spawn_world(sync_counts.worker, args=(free_port(), str(out), DDP_CAPS_MB), nprocs=WORLD)
    loaded = load_rank_results(out, WORLD)
    return loaded


def _sync_counts(record: object) -> dict[str, tuple[int, int]]:
    """The step's collectives but the attention all-to-alls (test_collective_counts checks those)."""
    counts: dict[str, tuple[int, int]] = record["counts"]  # type: ignore[index]
    return {name: c for name, c in counts.items() if name != "all_to_all_single"}


def _ddp_model(cap_mb: float | None) -> CostModel:
    bucket = DDP_DEFAULT_BUCKET_BYTES if cap_mb is None else round(cap_mb * 2**20) // FP32_OVER_BF16
    return _cost_model(grad_sync="ddp", ddp_bucket_bytes=bucket, state_sharding="replicated")


def test_the_reference_model_is_the_analytic_one() -> None:
    assert _cost_model().file.num_params * 4 == FP32_GRAD_BYTES


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cap_mb", DDP_CAPS_MB)
def test_ddp_bucket_allreduces_match_the_cost_model(runs: list[dict[str, object]], cap_mb: float | None
                                                    ) -> None:
    (call,) = _ddp_model(cap_mb).grad_sync_calls()
    assert (call.op, call.num_calls) == ("allreduce", DDP_BUCKETS[cap_mb])
    expected = {"all_reduce": (call.num_calls, call.bytes_per_rank * FP32_OVER_BF16)}
    for r, res in enumerate(runs):
        assert _sync_counts(res[f"ddp_{cap_mb}"]) == expected, r


@pytest.mark.timeout(240)
def test_fsdp2_gathers_and_reduce_scatters_match_the_cost_model(runs: list[dict[str, object]]) -> None:
    calls = _cost_model(grad_sync="fsdp2").grad_sync_calls()
    assert [c.op for c in calls] == ["allgather", "reducescatter"]
    expected = {name: (c.num_calls, c.bytes_per_rank * FP32_OVER_BF16)
                for name, c in zip(("all_gather_single", "reduce_scatter_single"), calls, strict=True)}
    assert expected["all_gather_single"][0] == CONFIG.num_layers + 1
    for r, res in enumerate(runs):
        assert _sync_counts(res["fsdp2"]) == expected, r


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cap_mb", DDP_CAPS_MB)
def test_ddp_state_bytes_match_the_cost_model(runs: list[dict[str, object]], cap_mb: float | None) -> None:
    cm = _ddp_model(cap_mb)
    want = _fp32_state_bytes(cm, sharded_params=False)
    assert want == 5 * FP32_GRAD_BYTES  # params, grads, bucket buffers, two moments
    for r, res in enumerate(runs):
        assert res[f"ddp_{cap_mb}"]["after_step_state_bytes"] == want, r  # type: ignore[index]


@pytest.mark.timeout(240)
def test_fsdp2_peak_state_bytes_match_the_cost_model(runs: list[dict[str, object]]) -> None:
    cm = _cost_model(grad_sync="fsdp2")
    want = _fp32_state_bytes(cm, sharded_params=True)
    for r, res in enumerate(runs):
        record = res["fsdp2"]
        assert record["peak_state_bytes"] == want, r  # type: ignore[index]
        # after the step only shards are left: parameters, gradients, two moments
        assert record["after_step_state_bytes"] == 4 * FP32_GRAD_BYTES / WORLD, r  # type: ignore[index]


@pytest.mark.timeout(240)
def test_no_collective_escapes_the_count(runs: list[dict[str, object]]) -> None:
    """The gloo backend ran exactly the wrapped calls (the profiler sees C++-issued ones too, such
    as DDP's one-off bucket-order broadcast in the step before). gloo has no reduce-scatter: it
    runs FSDP2's as an all-reduce (NCCL, which the cost model prices, runs a reduce-scatter)."""
    backend = {"all_reduce": "gloo:all_reduce", "reduce_scatter_single": "gloo:all_reduce",
               "all_gather_single": "gloo:all_gather", "all_to_all_single": "gloo:all_to_all"}
    for r, res in enumerate(runs):
        for key in [f"ddp_{cap}" for cap in DDP_CAPS_MB] + ["fsdp2"]:
            record: dict[str, dict[str, tuple[int, int]]] = res[key]  # type: ignore[assignment]
            expected: dict[str, int] = {}
            for name, (calls, _) in record["counts"].items():
                expected[backend[name]] = expected.get(backend[name], 0) + calls
            assert record["backend_ops"] == expected, (r, key)
