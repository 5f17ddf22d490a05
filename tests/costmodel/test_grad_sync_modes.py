"""The cost model's gradient sync and model states per executor sync mode (ClusterSpec.grad_sync),
by hand on LLaMA-7B over 32 H200s (4 nodes: rings run at the network link, 30 us a step).

The counts themselves are checked against what DDP and FSDP2 issue on gloo in
tests/executor/test_sync_cost_model.py.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from costmodel.analytic import analytic_cost_model, num_params
from costmodel.evaluate import CostModel
from costmodel.grad_sync import ddp_num_buckets, param_tensor_elements
from costmodel.presets import load_cluster, load_model, model_names

P = 6_738_415_616  # LLaMA-7B parameters
GRAD_BYTES = P * 2
NET = 50e9 * 0.8
STEP_S = 30e-6
N = 32


def _cm(**cluster: object) -> CostModel:
    spec = load_cluster("h200x32", **cluster)
    return CostModel(file=analytic_cost_model(load_model("llama-7b"), spec.hardware), cluster=spec)


def test_default_is_the_one_allreduce() -> None:
    assert _cm().cluster.grad_sync == "allreduce"
    assert _cm().grad_sync_time_s() == _cm(grad_sync="allreduce").grad_sync_time_s()


def test_ddp_pays_a_latency_per_bucket() -> None:
    # bf16 tensors in gradient-ready order: head (262 MB) closes the 1 MiB first bucket; then per
    # layer [norm, down 90 MB], [up], [gate], [norm, out 34 MB], [qkv 101 MB] (each >= 25 MiB);
    # the last bucket holds the first layer's norm and the embedding: 1 + 5*32 + 1 buckets
    buckets = 1 + 5 * 32 + 1
    assert ddp_num_buckets([n * 2 for n in param_tensor_elements(load_model("llama-7b"))],
                           bucket_bytes=25 * 2**20) == buckets
    (call,) = _cm(grad_sync="ddp", state_sharding="replicated").grad_sync_calls()
    assert (call.op, call.num_calls, call.bytes_per_rank) == ("allreduce", buckets, GRAD_BYTES)
    expected = buckets * 2 * (N - 1) * STEP_S + 2 * (N - 1) / N * GRAD_BYTES / NET
    assert _cm(grad_sync="ddp", state_sharding="replicated").grad_sync_time_s() == pytest.approx(expected)
    # a 1 GiB cap: G / cap = 12.55, and each bucket overshoots its cap by part of a tensor: 12
    assert _cm(grad_sync="ddp", ddp_bucket_bytes=2**30).grad_sync_calls()[0].num_calls == 12
    # with ZeRO-1 the updated parameters are all-gathered as under the plain all-reduce
    zero1 = _cm(grad_sync="ddp").grad_sync_time_s() - _cm(grad_sync="ddp", state_sharding="replicated"
                                                          ).grad_sync_time_s()
    assert zero1 == pytest.approx((N - 1) * STEP_S + (N - 1) / N * GRAD_BYTES / NET)


def test_fsdp2_gathers_and_reduce_scatters_per_unit() -> None:
    calls = _cm(grad_sync="fsdp2").grad_sync_calls()
    assert [(c.op, c.num_calls, c.bytes_per_rank) for c in calls] == [
        ("allgather", 33, GRAD_BYTES), ("reducescatter", 33, GRAD_BYTES)]
    expected = 2 * 33 * (N - 1) * STEP_S + 2 * (N - 1) / N * GRAD_BYTES / NET
    assert _cm(grad_sync="fsdp2").grad_sync_time_s() == pytest.approx(expected)


def test_model_states_per_mode() -> None:
    cases: list[tuple[dict[str, object], float]] = [
        ({"grad_sync": "ddp", "state_sharding": "replicated"}, 18 * P),
        ({"grad_sync": "ddp", "state_sharding": "replicated", "ddp_gradient_as_bucket_view": True}, 16 * P),
        ({"grad_sync": "ddp"}, 6 * P + 12 * P / N),
        ({"grad_sync": "fsdp2"}, 4 * P + 12 * P / N),
    ]
    for cluster, expected in cases:
        assert _cm(**cluster).model_state_bytes() == pytest.approx(expected), cluster


def test_parameter_tensors_add_up_to_the_model() -> None:
    for name in model_names():
        model = load_model(name)
        assert sum(param_tensor_elements(model)) == num_params(model), name


def test_inconsistent_sync_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="state_sharding='replicated' with grad_sync='fsdp2'"):
        load_cluster("h200x32", grad_sync="fsdp2", state_sharding="replicated")
    with pytest.raises(ValidationError, match="ddp_bucket_bytes=.*grad_sync='allreduce'"):
        load_cluster("h200x32", ddp_bucket_bytes=2**20)
    with pytest.raises(ValidationError, match="ddp_gradient_as_bucket_view=True.*grad_sync='fsdp2'"):
        load_cluster("h200x32", grad_sync="fsdp2", ddp_gradient_as_bucket_view=True)
    with pytest.raises(ValidationError, match="ddp_bucket_bytes"):
        load_cluster("h200x32", grad_sync="ddp", ddp_bucket_bytes=0)
    with pytest.raises(ValidationError, match="grad_sync"):
        load_cluster("h200x32", grad_sync="zero")
