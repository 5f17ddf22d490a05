"""A sliding-window layer's ring runs only the steps whose blocks some query's window reaches, and
the cost model charges only those (costmodel/ring/window.py, timing.py, costs.py).

The step counts by hand (a ring of 4 over a 128-token window: 2 of 3 remote steps with zig-zag
chunks, 1 of 3 with contiguous ones) and against every (query, key) pair of small samples counted
one by one; the ring's time by hand on the steps that run; a model's layer mix averaging full and
windowed layers; the planner's vectorised form equal to the one-call form with windows. The
bounds' per-sample shares: under any call of their samples, by hand on one sample, and equal to a
one-sample call where their inequalities are equalities (steps compute-bound, or hop-bound with
every step run), so a share loosened anywhere (steps, hops, merges, attention) fails."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import CostModel
from costmodel.ring import (
    P2PLinks,
    RingCoefficients,
    call_remote_steps,
    needed_positions,
    remote_steps,
    ring_attention_time_s,
)
from costmodel.ring.window import chunk_reach, hop_tokens
from costmodel.specs import ModelSpec
from tests.costmodel.test_ring import IDEAL, LINKS, RING
from tests.costmodel.test_ring_priced import _cost_model


def _ring(tokens: list[int], *, r: int, ring: RingCoefficients = RING, window: int | None = None,
          additive_only: bool = False) -> tuple[float, float, float, float]:
    return ring_attention_time_s(tokens, ulysses_degree=1, ring_degree=r, forward_s_per_pair=1e-9,
                                 backward_s_per_pair=2e-9, kv_bytes_per_token=100.0, query_channels=64,
                                 links=LINKS, crosses_nodes=False, hbm_bytes_per_s=1e12, ring=ring, window=window,
                                 additive_only=additive_only)


def _pairs_by_hand(tokens: int, window: int, ring_degree: int, chunking: str) -> int:
    """Remote steps of the busiest position, from every (query, key) pair in the window."""
    chunks = 2 * ring_degree if chunking == "zigzag" else ring_degree
    c = tokens // chunks

    def owner(pos: int) -> int:
        chunk = pos // c
        return chunk if chunking == "contiguous" or chunk < ring_degree else 2 * ring_degree - 1 - chunk

    needs: dict[int, set[int]] = {i: set() for i in range(ring_degree)}
    for q in range(tokens):
        for k in range(max(0, q - window + 1), q + 1):
            needs[owner(q)].add(owner(k))
    return max(len(n - {i}) for i, n in needs.items())


def test_a_ring_of_four_over_a_128_token_window_by_hand() -> None:
    # 4,096 tokens: zig-zag chunks of 512, each query chunk needs itself and the chunk before
    assert int(chunk_reach(4096, window=128, chunks=8)) == 1
    assert needed_positions(0, reach=1, ring_degree=4) == {0, 1}  # chunks 0, 7: 7 needs 6 (position 1)
    assert needed_positions(1, reach=1, ring_degree=4) == {0, 1, 2}  # chunks 1, 6: 0 and 5 (position 2)
    assert needed_positions(3, reach=1, ring_degree=4) == {2, 3}  # chunks 3, 4: 2 (position 2), 3 (its own)
    assert int(remote_steps(4096, window=128, ring_degree=4)) == 2
    # contiguous chunks of 1,024: each position needs only its predecessor
    assert needed_positions(0, reach=1, ring_degree=4, chunking="contiguous") == {0}
    assert needed_positions(2, reach=1, ring_degree=4, chunking="contiguous") == {1, 2}
    assert int(remote_steps(4096, window=128, ring_degree=4, chunking="contiguous")) == 1
    # the edge: chunks of 127 tokens keep a 128-token window inside one chunk back, 126 do not
    assert remote_steps([8 * 127, 8 * 126], window=128, ring_degree=4).tolist() == [2, 3]
    # a sample shorter than the window needs every block; a window of one token none
    assert int(remote_steps(64, window=128, ring_degree=4)) == 3
    assert int(remote_steps(4096, window=1, ring_degree=4)) == 0
    # a call runs what its neediest sample needs
    assert call_remote_steps([4096, 64], window=128, ring_degree=4) == 3
    assert call_remote_steps([4096, 65536], window=128, ring_degree=4) == 2
    # a needed step brings the 127 keys before the receiver's first query, or a short sample's block
    assert hop_tokens([4096, 256, 64], window=128, ring_degree=4).tolist() == [127, 64, 16]


@pytest.mark.parametrize("chunking", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring_degree", [2, 3, 4])
def test_steps_equal_the_pairs_counted_one_by_one(chunking: str, ring_degree: int) -> None:
    chunks = 2 * ring_degree if chunking == "zigzag" else ring_degree
    for tokens in (chunks * 2, chunks * 5, chunks * 16):
        for window in (1, 2, 3, 5, 9, 17, 40):
            expected = _pairs_by_hand(tokens, window, ring_degree, chunking)
            got = int(remote_steps(tokens, window=window, ring_degree=ring_degree, chunking=chunking))
            assert got == expected, (tokens, window)


def test_bad_window_or_chunking_names_the_value() -> None:
    with pytest.raises(ValueError, match="window"):
        remote_steps(4096, window=0, ring_degree=4)
    with pytest.raises(ValueError, match="chunking"):
        remote_steps(4096, window=128, ring_degree=4, chunking="striped")
    with pytest.raises(ValueError, match="window must be a positive integer"):
        _ring([4096], r=4, window=-3)


def test_windowed_ring_time_by_hand() -> None:
    """4,096 tokens, a ring of 4, a 128-token window: the local block and 2 remote ones run, the
    rank's windowed pairs split over the 3 steps; 2 hops of the 127 keys the window reaches (not
    the 1,024-token block), 2 merges, the gradients' hop home."""
    s, w = 4096, 128
    fwd, bwd, exp_f, exp_b = _ring([s], r=4, window=w)
    m = s - w
    step = (s * s - m * (m + 1)) / 4 / 3 * 1e-9  # the rank's quarter of the windowed pairs, a third a step
    hop, hop2 = 1e-5 + 127 * 100 / 1e9, 1e-5 + 2 * 127 * 100 / 1e9
    merges = 2 * 1024 * 64 * 12 / 1e12
    big, small = max(step, hop), min(step, hop)
    assert fwd == pytest.approx(2 * (big + 0.25 * small + 5e-6) + step + 5e-6 + merges, rel=1e-12)
    assert exp_f == pytest.approx(fwd - 3 * step, rel=1e-12)  # what the per-sample terms do not charge
    big2, small2 = max(2 * step, hop2), min(2 * step, hop2)
    assert bwd == pytest.approx(2 * (big2 + 0.25 * small2 + 5e-6) + 2 * step + 5e-6 + hop, rel=1e-12)
    assert exp_b == pytest.approx(bwd - 6 * step, rel=1e-12)
    # ideal overlap: the 2 small hops hide under the steps, only the 2 merges show, where the
    # full-attention ring of the same sample merges 3 times
    assert hop < step
    _, _, win_f, _ = _ring([s], r=4, ring=IDEAL, window=w)
    assert win_f == pytest.approx(merges, rel=1e-12)
    _, _, full_f, _ = _ring([s], r=4, ring=IDEAL)
    assert full_f == pytest.approx(merges * 3 / 2, rel=1e-12)


def test_a_sample_inside_the_window_runs_the_full_ring() -> None:
    assert _ring([64], r=4, window=128) == pytest.approx(_ring([64], r=4), rel=1e-12)


def _windowed(cm: CostModel, layer_types: tuple[str, ...], window: int) -> CostModel:
    model = ModelSpec(**{**cm.file.model.model_dump(), "layer_types": layer_types, "sliding_window": window})
    return CostModel(file=cm.file.model_copy(update={"model": model}), cluster=cm.cluster)


def test_layer_mix_charges_each_layer_type_its_steps() -> None:
    """The tiny model with 2 of its 3 layers windowed (128 tokens): a call's ring is the full
    layer's and twice the windowed layer's, over the layers (and a recomputed forward more)."""
    base = _cost_model(gpus=8, gpn=4)
    cm = _windowed(base, ("sliding_attention", "full_attention", "sliding_attention"), 128)
    layout = cm.place(first_rank=0, group_size=4, ring_degree=4)
    tokens = [4096.0, 2048.0]
    full = cm.ring_layer_time(tokens, layout=layout)
    slide = cm.ring_layer_time(tokens, layout=layout, sliding=True)
    assert slide.exposed_forward_s < full.exposed_forward_s and slide.exposed_backward_s < full.exposed_backward_s
    per_layer = (full.exposed_forward_s + full.exposed_backward_s
                 + 2 * (slide.exposed_forward_s + slide.exposed_backward_s))
    assert cm.ring_exposed_s(tokens, [0, 0], layout=layout) == pytest.approx(per_layer, rel=1e-12)
    recompute = (full.exposed_forward_s + 2 * slide.exposed_forward_s) / 3 * 2  # 2 of 3 layers, averaged
    assert cm.ring_exposed_s(tokens, [2, 2], layout=layout) == pytest.approx(per_layer + recompute, rel=1e-12)
    # the full-attention twin charges every layer the full ring
    assert base.ring_exposed_s(tokens, [0, 0], layout=layout) == pytest.approx(
        3 * (full.exposed_forward_s + full.exposed_backward_s), rel=1e-12)
    # a short sample in the call makes the windowed layer run every step (a call runs its neediest)
    both = cm.ring_layer_time([4096.0, 64.0], layout=layout, sliding=True)
    long = cm.ring_layer_time([4096.0], layout=layout, sliding=True)
    alone = cm.ring_layer_time([4096.0, 64.0], layout=layout)
    assert both.exposed_forward_s - long.exposed_forward_s > 5e-6  # a fourth step's cost, at least
    assert both.forward_s < alone.forward_s  # fewer pairs and keys on the same 4 steps


def test_many_equals_one_by_one_with_windows() -> None:
    cm = _windowed(_cost_model(gpus=8, gpn=4), ("sliding_attention", "full_attention", "sliding_attention"), 300)
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, 6, 40)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    tokens = rng.integers(16, 20_000, int(sizes.sum())).astype(np.float64)
    ks = rng.integers(0, 4, int(sizes.sum()))
    for layout in (cm.place(first_rank=0, group_size=4, ring_degree=4), cm.place(first_rank=2, group_size=8,
                                                                                 ring_degree=2)):
        many = cm.ring_exposed_many_s(tokens, ks, starts, layout=layout)
        ends = [*starts[1:].tolist(), len(tokens)]
        one = [cm.ring_exposed_s(tokens[a:b].tolist(), ks[a:b].tolist(), layout=layout)
               for a, b in zip(starts.tolist(), ends, strict=True)]
        assert many.tolist() == pytest.approx(one, rel=1e-12)


def test_sliding_needs_a_window() -> None:
    with pytest.raises(ValueError, match="no sliding_window"):
        _cost_model().ring_layer_time([4096.0], layout=_cost_model().place(first_rank=0, group_size=4,
                                                                           ring_degree=4), sliding=True)


def _without_fixed_costs(*, window: int, bytes_per_s: float | None = None) -> CostModel:
    """The tiny model with 2 of its 3 layers windowed, on links without latency and rings without a
    per-step cost, which the bounds' shares leave out and which would hide a loose share
    (``bytes_per_s``: both links' bandwidth, default :data:`LINKS`')."""
    base = _cost_model(gpus=8, gpn=4)
    bandwidth = {} if bytes_per_s is None else {"bytes_per_s": bytes_per_s}
    links = P2PLinks(intra=LINKS.intra.model_copy(update={"alpha_s": 0.0, **bandwidth}),
                     inter=LINKS.inter.model_copy(update={"alpha_s": 0.0, **bandwidth}))  # type: ignore[union-attr]
    comm = base.file.comm.model_copy(update={"p2p": links, "ring": RingCoefficients(step_overhead_s=0.0)})
    base = CostModel(file=base.file.model_copy(update={"comm": comm}), cluster=base.cluster)
    return _windowed(base, ("sliding_attention", "full_attention", "sliding_attention"), window)


def test_additive_shares_stay_under_a_windowed_call() -> None:
    """The bounds' per-sample shares (``additive_only``, compute- or hop-bound form) sum under the
    ring of any call of those samples, though a call runs as many steps as its neediest sample."""
    cm = _without_fixed_costs(window=3000)
    rng = np.random.default_rng(3)
    for layout in (cm.place(first_rank=0, group_size=4, ring_degree=4), cm.place(first_rank=2, group_size=8,
                                                                                 ring_degree=4)):
        for _ in range(30):
            tokens = rng.integers(16, 30_000, int(rng.integers(1, 6))).astype(np.float64)
            if rng.random() < 0.5:
                tokens[0] = float(rng.integers(16, 3000))  # a sample the window covers: every step runs
            call = cm.ring_exposed_s(tokens.tolist(), [0] * len(tokens), layout=layout)
            for weights in (None, tokens):
                low_f, low_b = cm.ring_alone_exposed_s(tokens, layout=layout, additive_only=True, weights=weights)
                assert cm.num_layers * float((low_f + low_b).sum()) <= call * (1 + 1e-12)
            columns = cm._ring_columns(tokens, layout)  # every form, the hop-bound ones too
            for lam in (0.0, 0.5, 1.0):
                low_f, low_b = cm._exposed_from_columns(columns, layout, additive_only=True, compute_weight=lam)
                assert cm.num_layers * float((low_f + low_b).sum()) <= call * (1 + 1e-12), lam


def test_windowed_share_by_hand() -> None:
    """A sample's share of any call, in the compute-bound form, by hand: 4,096 tokens, a ring of
    4, a 128-token window: the 2 remote steps the window reaches (3 steps with the local block)
    each hop the 127 keys it reaches, exposed at the exposed fraction (0.25) and without latency,
    and merge once; the backward's hops carry twice the bytes, then the gradients' hop home."""
    hop_bytes_s = 127 * 100 / 1e9
    merges = 2 * 1024 * 64 * 12 / 1e12
    fwd, bwd, exp_f, exp_b = _ring([4096], r=4, window=128, additive_only=True)
    assert exp_f == pytest.approx(2 * 0.25 * hop_bytes_s + merges, rel=1e-12)
    assert exp_b == pytest.approx(2 * 0.25 * 2 * hop_bytes_s + hop_bytes_s, rel=1e-12)
    m = 4096 - 128
    step = (4096 * 4096 - m * (m + 1)) / 4 / 3 * 1e-9  # the rank's quarter of the windowed pairs, a third a step
    assert fwd - exp_f == pytest.approx(3 * step, rel=1e-12)  # the attention the per-sample terms charge
    assert bwd - exp_b == pytest.approx(3 * 2 * step, rel=1e-12)


@pytest.mark.parametrize(("form", "bytes_per_s", "window", "tokens", "remote"), [
    # compute-bound steps (fast links) on long samples: the window reaching both neighbours' blocks
    ("compute", 1e9, 128, [8192.0, 4096.0, 2048.0], 2),
    # ... or every block
    ("compute", 1e9, 600, [4096.0, 2560.0], 3),
    # hop-bound steps (slow links) on samples whose windows reach every block
    ("hop", 1e6, 128, [32.0, 64.0, 96.0, 200.0, 256.0, 640.0], 3),
])
def test_windowed_shares_are_exact_on_one_sample(form: str, bytes_per_s: float, window: int, tokens: list[float],
                                                 remote: int) -> None:
    """The bounds' share of a sample alone equals its call's exposed ring where the share's
    inequalities are equalities: no latency, no per-step cost, and every step compute-bound
    (compute form: ``max(c, h) = c``) or hop-bound with every step run (hop form: ``max(c, h) =
    h``, and the share's attention, charged at ``r`` steps, is the call's). A share charged fewer
    steps, hops, merges or attention than the call falls below it here; the steps it charges are
    those the window reaches, counted from every (query, key) pair (on the tiny model, 2 of its 3
    layers windowed, a ring of 4 in one node)."""
    r = 4
    cm = _without_fixed_costs(window=window, bytes_per_s=bytes_per_s)
    layout = cm.place(first_rank=0, group_size=4, ring_degree=r)
    s = np.asarray(tokens)
    columns = cm._ring_columns(s, layout)
    assert [_pairs_by_hand(int(t), window, r, "zigzag") for t in tokens] == [remote] * len(tokens)
    assert columns[:, -1].tolist() == [remote] * len(tokens)  # the remote steps the share charges
    low_f, low_b = cm._exposed_from_columns(columns, layout, additive_only=True,
                                            compute_weight=1.0 if form == "compute" else 0.0)
    alone_f, alone_b = cm.ring_alone_exposed_s(s, layout=layout, additive_only=True)  # the larger form
    for i, t in enumerate(tokens):
        call = cm.ring_exposed_s([t], [0], layout=layout)  # every layer once, forward and backward
        assert cm.num_layers * float(low_f[i] + low_b[i]) == pytest.approx(call, rel=1e-12), t
        assert cm.num_layers * float(alone_f[i] + alone_b[i]) == pytest.approx(call, rel=1e-12), t
