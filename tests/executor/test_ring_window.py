"""A ring over a sliding-window layer runs only the steps whose blocks some query's window reaches,
and its outputs and gradients equal plain windowed attention (fp64, 4 gloo ranks).

A ring of 4 over a 128-token window on samples of 1,096 and 1,040 tokens: with the zig-zag chunks
(137 and 130 tokens, at least the window less one) a ring position needs only its neighbours'
blocks, 2 of its 3 remote steps (the two ends 1); with contiguous chunks only its predecessor's,
1 of 3 (the first none). The steps are counted from the ring's own events on the real ranks (a
block's attention, its send and receive, forward and backward), and every send has its receive
at the same step on the other side. The reference is per-sample softmax attention under the
window mask, written here on the whole tensors in one process. Also: a packed short sample (its
window covers every block: all steps run), a Ulysses 2 x ring 2 group, a window of one token
(no remote step at all), and gpt-oss' attention sinks (a logit per head in every softmax, no key
or value) on a windowed and on a full ring, their gradients summed over the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from costmodel.ring import remote_steps
from costmodel.ring.window import hop_tokens
from dcp_cli.net import free_port
from executor.layout import SampleShape
from executor.ring_layout import RingGroups, RingLayout
from tests.executor.helpers import gloo_rank, load_rank_results
from tests.executor.window_reference import HEAD_DIM, HEADS, full_tensors, local_rows, sink_logits, windowed_reference
from tests.executor.worlds import spawn_world

WORLD = 4
WINDOW = 128
LONG = (SampleShape(tokens=1096), SampleShape(tokens=1040))
CASES: dict[str, tuple[tuple[SampleShape, ...], int, int, str, int | None, bool]] = {
    # name: (samples, u, r, chunking, window, sinks)
    "zigzag": (LONG, 1, 4, "zigzag", WINDOW, False),
    "contiguous": (LONG, 1, 4, "contiguous", WINDOW, False),
    "short_packed": ((SampleShape(tokens=1096), SampleShape(tokens=40)), 1, 4, "zigzag", WINDOW, False),
    "hybrid": (LONG, 2, 2, "zigzag", WINDOW, False),
    "window_one": (LONG, 1, 4, "zigzag", 1, False),
    "zigzag_sinks": (LONG, 1, 4, "zigzag", WINDOW, True),  # gpt-oss' sliding layers
    "full_sinks": ((SampleShape(tokens=96), SampleShape(tokens=40)), 1, 4, "zigzag", None, True),  # its full ones
}


def _layout(name: str, rank: int) -> RingLayout:
    samples, u, r, chunking, _, _ = CASES[name]
    return RingLayout(samples=samples, ulysses_degree=u, ring_degree=r, index_in_group=rank % (u * r),
                      chunking=chunking)


def _worker(rank: int, port: int, out_dir: str) -> None:
    from executor.ring import record_ring_events, ring_head_to_seq, ring_packed_attention, ring_seq_to_head

    with gloo_rank(rank, WORLD, port, out_dir) as results:
        whole = dist.new_group([0, 1, 2, 3])
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        for name, (samples, u, r, _, window, sinks) in CASES.items():
            group = (RingGroups(ulysses=None, ring=whole) if (u, r) == (1, 4)
                     else RingGroups(ulysses=pairs[rank // 2], ring=strided[rank % 2]))
            layout = _layout(name, rank)
            q, k, v, g = (local_rows(t, layout) for t in full_tensors(samples, 0))
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            sink = sink_logits().requires_grad_(True) if sinks else None  # u = 1: every head on every rank
            with record_ring_events() as events:
                qh, kh, vh = (ring_seq_to_head(t, layout, group) for t in (q, k, v))
                o = ring_packed_attention(qh, kh, vh, layout=layout, group=group.ring, kind="causal_1d",
                                          window=window, sinks=sink)
                out = ring_head_to_seq(o, layout, group)
                (out * g).sum().backward()
            results[name] = (out.detach(), q.grad, k.grad, v.grad)
            results[f"{name}_sinks"] = None if sink is None else sink.grad
            results[f"{name}_events"] = list(events)


@pytest.fixture(scope="module")
def window_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp("ring_window"))
    spawn_world(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    return load_rank_results(out, WORLD)


def _steps(events: object, pass_: str, what: str) -> list[int]:
    assert isinstance(events, list)
    return sorted(step for p, step, w in events if p == pass_ and w == what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_windowed_ring_equals_plain_windowed_attention(window_results: list[dict[str, object]], name: str) -> None:
    samples, _, _, _, window, sinks = CASES[name]
    want = windowed_reference(samples, window, sinks)
    # a real key gradient (a one-token window has none: each softmax is over one key)
    assert float(want[3 if window == 1 else 2].abs().max()) > 1e-3
    for rank, res in enumerate(window_results):
        layout = _layout(name, rank)
        got = res[name]
        assert isinstance(got, tuple)
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want[:4], strict=True):
            diff = float((g - local_rows(w, layout)).abs().max())
            assert diff <= 1e-10, f"rank {rank}, {name}: {what} differs by {diff:.2e}"
    if sinks:  # each rank's sinks gradient is its queries' share: the ranks' sum is the whole
        parts = [res[f"{name}_sinks"] for res in window_results]
        assert all(isinstance(p, torch.Tensor) for p in parts)
        total = torch.stack(parts).sum(0)  # type: ignore[arg-type]
        assert float(want[4].abs().max()) > 1e-3
        assert float((total - want[4]).abs().max()) <= 1e-10


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "remote_by_rank"), [
    ("zigzag", [[3], [1, 3], [1, 3], [1]]),  # position j needs j - 1 (step 1) and j + 1 (step 3), in the ring
    ("contiguous", [[], [1], [1], [1]]),  # position j needs j - 1 only
    ("short_packed", [[1, 2, 3]] * 4),  # the 40-token sample's window spans every block
    ("window_one", [[]] * 4),  # a token sees only itself: no remote block
    ("zigzag_sinks", [[3], [1, 3], [1, 3], [1]]),  # sinks depend on no block: the same steps
])
def test_a_ring_of_four_runs_only_the_steps_the_window_reaches(window_results: list[dict[str, object]],
                                                               name: str, remote_by_rank: list[list[int]]) -> None:
    samples, _, r, chunking, window, _ = CASES[name]
    assert window is not None
    sent: dict[tuple[str, int, int], int] = {}
    for rank, res in enumerate(window_results):
        events = res[f"{name}_events"]
        for pass_ in ("forward", "backward"):
            attended = [s for s in _steps(events, pass_, "attend") if s > 0]
            assert attended == remote_by_rank[rank], (rank, pass_)
            assert _steps(events, pass_, "recv kv") == attended, (rank, pass_)  # a block received is attended
            for step in _steps(events, pass_, "send kv"):
                sent[(pass_, step, (rank + step) % r)] = sent.get((pass_, step, (rank + step) % r), 0) + 1
        assert _steps(events, "backward", "send dkv") == remote_by_rank[rank]  # its gradients go home
    # every block sent at step k is the one position j + k receives at step k, and only that
    received = {(pass_, step, rank): 1 for rank, res in enumerate(window_results) for pass_ in ("forward", "backward")
                for step in _steps(res[f"{name}_events"], pass_, "recv kv")}
    assert sent == received
    # the count the cost model charges: the busiest position's remote steps
    most = max(len(steps) for steps in remote_by_rank)
    assert int(remote_steps([s.tokens for s in samples], window=window, ring_degree=r, chunking=chunking).max()) == most
    if name in ("zigzag", "contiguous"):
        assert most == {"zigzag": 2, "contiguous": 1}[name]


def test_window_needs_causal_attention_and_a_positive_size() -> None:
    from executor.ring import ring_attention

    layout = _layout("zigzag", 0)
    q = torch.zeros(layout.ring_tokens(0), HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="window=0 must be a positive integer"):
        ring_attention(q, q, q, layout=layout, group=None, causal=True, window=0)
    with pytest.raises(ValueError, match="causal=False"):
        ring_attention(q, q, q, layout=layout, group=None, causal=False, window=WINDOW)
    with pytest.raises(ValueError, match="chunking must be one of"):
        RingLayout(samples=LONG, ulysses_degree=1, ring_degree=4, index_in_group=0, chunking="striped")


@pytest.mark.parametrize("chunking", ["zigzag", "contiguous"])
def test_only_the_keys_a_window_reaches_travel(chunking: str) -> None:
    """The rows a position sends another are exactly the keys some query of the receiver sees,
    counted here from every (query, key) pair of the two blocks; under the 128-token window the
    last 127 keys of a neighbour's chunk per sample, not its whole block."""
    from executor.ring_layout import needed_rows

    samples = (SampleShape(tokens=700), SampleShape(tokens=40), SampleShape(tokens=300))
    for r in (2, 3, 4):
        layout = RingLayout(samples=samples, ulysses_degree=1, ring_degree=r, index_in_group=0, chunking=chunking)
        for window in (None, 1, 2, 5, WINDOW, 500):
            for q_index in range(r):
                q_sample, q_pos = layout.ring_table(q_index)
                for k_index in range(r):
                    k_sample, k_pos = layout.ring_table(k_index)
                    seen = (q_sample[:, None] == k_sample[None, :]) & (k_pos[None, :] <= q_pos[:, None])
                    if window is not None:
                        seen &= k_pos[None, :] > q_pos[:, None] - window
                    got = needed_rows(layout, query_index=q_index, key_index=k_index, causal=True, window=window)
                    assert got.tolist() == torch.nonzero(seen.any(0)).flatten().tolist(), (r, window)
    ring = RingLayout(samples=LONG, ulysses_degree=1, ring_degree=4, index_in_group=0, chunking=chunking)
    charged = hop_tokens([s.tokens for s in LONG], window=WINDOW, ring_degree=4).sum()  # what the cost model charges
    assert charged == 2 * 127
    for j in range(1, 4):
        assert needed_rows(ring, query_index=j, key_index=j - 1, causal=True, window=WINDOW).numel() == charged
