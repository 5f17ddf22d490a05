"""``CostModel.ring_exposed_many_s`` (the planner's vectorised form) is ``ring_exposed_s`` of every
micro-batch, to the bit: one-policy and mixed-policy micro-batches, rings inside a node and across
nodes, hops hidden and exposed."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.ring.timing import microbatches_exposed_s
from tests.costmodel.test_ring_priced import _cost_model


def _batch(rng: np.random.Generator, *, num_layers: int, num_mbs: int, max_tokens: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Micro-batches of 1-8 samples; half of them one policy, the others mixed policies."""
    sizes = rng.integers(1, 9, num_mbs)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    tokens = rng.integers(1, max_tokens, int(sizes.sum())).astype(np.float64)
    ks = rng.integers(0, num_layers + 1, int(sizes.sum()))
    for m in range(0, num_mbs, 2):
        ks[starts[m]:starts[m] + sizes[m]] = ks[starts[m]]
    return tokens, ks, starts


def _one_by_one(cm: CostModel, tokens: np.ndarray, ks: np.ndarray, starts: np.ndarray, layout) -> list[float]:
    ends = [*starts[1:].tolist(), len(tokens)]
    return [cm.ring_exposed_s(tokens[a:b].tolist(), ks[a:b].tolist(), layout=layout)
            for a, b in zip(starts.tolist(), ends, strict=True)]


@pytest.mark.parametrize(("size", "ring", "first_rank"), [(2, 2, 0), (4, 2, 0), (4, 4, 2), (8, 2, 0)])
def test_many_is_each_microbatch_alone_on_the_tiny_model(size: int, ring: int, first_rank: int) -> None:
    cm = _cost_model(gpus=8, gpn=4)
    layout = cm.place(first_rank=first_rank, group_size=size, ring_degree=ring)
    tokens, ks, starts = _batch(np.random.default_rng(size * 10 + ring), num_layers=cm.num_layers, num_mbs=60,
                                max_tokens=20_000)
    many = cm.ring_exposed_many_s(tokens, ks, starts, layout=layout)
    alone = _one_by_one(cm, tokens, ks, starts, layout)
    assert many.tolist() == alone  # the same sums in the same order: bitwise
    assert any(x > 0 for x in alone)


@pytest.mark.parametrize(("size", "ring", "first_rank"), [(16, 2, 0), (64, 8, 0), (32, 32, 8)])
def test_many_is_each_microbatch_alone_on_the_default_preset(size: int, ring: int, first_rank: int) -> None:
    cluster = load_cluster("h200x64")
    cm = CostModel(file=default_cost_model_file("llama-3.1-8b", cluster.hardware.name), cluster=cluster)
    layout = cm.place(first_rank=first_rank, group_size=size, ring_degree=ring)
    tokens, ks, starts = _batch(np.random.default_rng(size + ring), num_layers=cm.num_layers, num_mbs=200,
                                max_tokens=400_000)
    # the same sums in the same order; the efficiency curve's logarithms may differ in the last bit
    # between numpy's vector and scalar paths (arrays of other lengths), hence 1e-12
    assert cm.ring_exposed_many_s(tokens, ks, starts, layout=layout).tolist() == pytest.approx(
        _one_by_one(cm, tokens, ks, starts, layout), rel=1e-12)


def test_pure_ulysses_and_no_microbatches() -> None:
    cm = _cost_model()
    ulysses = cm.place(first_rank=0, group_size=4, ring_degree=1)
    assert cm.ring_exposed_many_s([100.0, 200.0], [0, 3], [0, 1], layout=ulysses).tolist() == [0.0, 0.0]
    empty = microbatches_exposed_s(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                                   num_layers=3, exposed=lambda s, q: (s, q))
    assert empty.shape == (0,)
