"""A ring's keys and values travel and are buffered at the model's element size (the file's
``comm.grad_bytes_per_param``: the profile's dtype for a fitted file, bf16 for the analytic one),
so an fp32 CPU-fitted model's ring costs fp32 bytes (was bf16 for every file)."""

from __future__ import annotations

import pytest

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster, load_model


def _models() -> tuple[CostModel, CostModel]:
    cluster = load_cluster("h200x32")
    bf16 = analytic_cost_model(load_model("llama-7b"), cluster.hardware)
    fp32 = bf16.model_copy(update={"comm": bf16.comm.model_copy(update={"grad_bytes_per_param": 4.0})})
    return CostModel(file=bf16, cluster=cluster), CostModel(file=fp32, cluster=cluster)


def test_ring_buffers_and_hops_use_the_files_element_size() -> None:
    bf16, fp32 = _models()
    assert (bf16.element_bytes, fp32.element_bytes) == (2.0, 4.0)
    model = bf16.file.model  # 32 heads, 32 key/value heads, head size 128: no replication below 32
    s, u, r = 8192, 2, 4
    layout = bf16.place(first_rank=0, group_size=u * r, ring_degree=r)
    for cm, element in ((bf16, 2), (fp32, 4)):
        ring = float(cm.activation_bytes(s, group_size=u * r, layout=layout)) - float(
            cm.activation_bytes(s, group_size=u * r))
        # 4 s/r tokens (two blocks in flight, keys and values, and their gradients) of 32/u heads
        assert ring == pytest.approx(4 * s / r * 2 * (model.kv_heads / u) * model.head_size * element, rel=1e-12)
    # a hop-bound ring across nodes (16 ranks, 2 nodes; short samples): its exposed time grows with the bytes
    wide = bf16.place(first_rank=0, group_size=16, ring_degree=16)
    t16 = bf16.ring_layer_time([64.0, 96.0], layout=wide)
    t32 = fp32.ring_layer_time([64.0, 96.0], layout=wide)
    assert t32.exposed_forward_s > t16.exposed_forward_s > 0
