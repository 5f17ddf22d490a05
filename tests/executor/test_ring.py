"""Ring attention and Ulysses x ring on gloo equal plain attention over each whole sample (fp64),
forward and backward.

4 ranks: a ring of 4, two rings of 2, and a 2 x 2 group (Ulysses over ranks {0, 1} and {2, 3},
rings over {0, 2} and {1, 3}); packed micro-batches of samples of uneven lengths (the zig-zag
chunks are uneven too); causal (1D) and non-causal (3D video). The reference is per-sample
softmax attention on the whole tensors in one process; the gradients of q, k and v reach the
rank that owns each token: the keys' and values' gradient sums travel with the blocks round the
ring and take a last hop home, then back through the all-to-all's backward.

The overlap is checked on the order of the ring's own events (``executor.ring.record_ring_events``,
recorded by the ring code on the real gloo ranks): every hop is posted before the compute it is
meant to hide and waited for after it, in forward and backward; the synchronous schedule
(``overlap_backward=False``) fails the same check, and both give the same gradients."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dcp_cli.net import free_port
from executor.layout import SampleShape
from executor.ring_layout import RingGroups, RingLayout
from tests.executor.helpers import gloo_rank, load_rank_results
from tests.executor.worlds import spawn_world

WORLD = 4
SAMPLES = (SampleShape(tokens=11, frames=1), SampleShape(tokens=9, frames=1), SampleShape(tokens=8, frames=2))
HEADS, HEAD_DIM = 2, 4
LAYOUTS = ((1, 4), (1, 2), (2, 2))
"""(u, r) of the groups checked: a ring of 4, rings of 2, Ulysses 2 x ring 2."""


def _full_tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(s.tokens for s in SAMPLES)
    q, k, v, g = (torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(4))
    return q, k, v, g


def _reference(causal: bool) -> tuple[torch.Tensor, ...]:
    """Output and gradients of q, k, v (loss: sum(out * g)) by plain per-sample attention."""
    q, k, v, g = _full_tensors(0)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    outs, start = [], 0
    for s in SAMPLES:
        end = start + s.tokens
        scores = torch.einsum("thd,uhd->htu", q[start:end], k[start:end]) / math.sqrt(HEAD_DIM)
        if causal:
            scores = scores.masked_fill(torch.ones(s.tokens, s.tokens, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("htu,uhd->thd", torch.softmax(scores, dim=-1), v[start:end]))
        start = end
    out = torch.cat(outs)
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


def _local(full: torch.Tensor, layout: RingLayout) -> torch.Tensor:
    offsets = layout.sample_offsets()
    return torch.cat([layout.shard(full[offsets[s]:offsets[s + 1]], s) for s in range(len(SAMPLES))])


def _layout(u: int, r: int, rank: int) -> RingLayout:
    return RingLayout(samples=SAMPLES, ulysses_degree=u, ring_degree=r, index_in_group=rank % (u * r))


def _worker(rank: int, port: int, out_dir: str) -> None:
    from executor.ring import (
        record_ring_events,
        ring_attention,
        ring_head_to_seq,
        ring_packed_attention,
        ring_seq_to_head,
    )

    with gloo_rank(rank, WORLD, port, out_dir) as results:
        whole = dist.new_group([0, 1, 2, 3])
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = {(1, 4): RingGroups(ulysses=None, ring=whole),
                  (1, 2): RingGroups(ulysses=None, ring=pairs[rank // 2]),
                  (2, 2): RingGroups(ulysses=pairs[rank // 2], ring=strided[rank % 2])}
        for (u, r), group in groups.items():
            layout = _layout(u, r, rank)
            for kind in ("causal_1d", "full_3d"):
                q, k, v, g = (_local(t, layout) for t in _full_tensors(0))
                q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
                qh, kh, vh = (ring_seq_to_head(t, layout, group) for t in (q, k, v))
                out = ring_head_to_seq(ring_packed_attention(qh, kh, vh, layout=layout, group=group.ring, kind=kind),
                                       layout, group)
                (out * g).sum().backward()
                results[f"{u}x{r}_{kind}"] = (out.detach(), q.grad, k.grad, v.grad)
        # The hop schedule of a ring of 4 (causal), backward overlapped and synchronous.
        layout = _layout(1, 4, rank)
        for overlap in (True, False):
            q, k, v, g = (_local(t, layout) for t in _full_tensors(1))  # u = 1: local = the ring position's
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            with record_ring_events() as events:
                out = ring_attention(q, k, v, layout=layout, group=whole, causal=True, overlap_backward=overlap)
                (out * g).sum().backward()
            results[f"events_{overlap}"] = list(events)
            results[f"grads_{overlap}"] = (q.grad, k.grad, v.grad)


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp("ring"))
    spawn_world(_worker, args=(free_port(), str(out)), nprocs=WORLD)
    loaded = load_rank_results(out, WORLD)
    return loaded


@pytest.mark.timeout(240)
@pytest.mark.parametrize("u_r", LAYOUTS)
@pytest.mark.parametrize("kind", ["causal_1d", "full_3d"])
def test_ring_attention_equals_whole_sample_attention(ring_results: list[dict[str, object]],
                                                      u_r: tuple[int, int], kind: str) -> None:
    u, r = u_r
    want = _reference(kind == "causal_1d")
    assert float(want[2].abs().max()) > 1e-3  # a real key gradient
    for rank, res in enumerate(ring_results):
        layout = _layout(u, r, rank)
        got = res[f"{u}x{r}_{kind}"]
        assert isinstance(got, tuple)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            diff = float((g - _local(w, layout)).abs().max()) / float(w.abs().max())
            assert diff <= 1e-12, f"rank {rank}, {u} x {r}, {kind}: {name} differs by {diff:.2e}"


def test_zigzag_balances_causal_work() -> None:
    """Every ring position of a causal sample gets the same number of (query, key) pairs up to one
    chunk's rounding; contiguous pieces would give the last position 2r - 1 times the first's."""
    tokens, r = 64, 4
    layout = RingLayout(samples=(SampleShape(tokens=tokens),), ulysses_degree=1, ring_degree=r, index_in_group=0)
    pairs = [int((layout.ring_table(j)[1] + 1).sum()) for j in range(r)]  # keys at or before each query
    assert max(pairs) == min(pairs), pairs
    contiguous = [sum(range(j * 16 + 1, j * 16 + 17)) for j in range(r)]
    assert max(contiguous) / min(contiguous) > 5


def test_ring_layout_covers_every_token_once() -> None:
    for u, r in ((1, 2), (2, 2), (1, 4), (4, 2), (3, 2)):
        seen: list[list[int]] = [[] for _ in SAMPLES]
        for g in range(u * r):
            layout = RingLayout(samples=SAMPLES, ulysses_degree=u, ring_degree=r, index_in_group=g)
            positions = layout.local_positions()
            assert positions.numel() == layout.local_tokens
            cut = 0
            for s in range(len(SAMPLES)):
                seen[s] += positions[cut:cut + layout.pieces[s][g]].tolist()
                cut += layout.pieces[s][g]
        assert [sorted(p) for p in seen] == [list(range(s.tokens)) for s in SAMPLES], (u, r)


def test_bad_layouts_name_the_value() -> None:
    with pytest.raises(ValueError, match="ulysses_degree=3 x ring_degree=2 does not multiply to the group size 4"):
        from executor.ring_layout import check_layout_degrees
        check_layout_degrees(group_size=4, ulysses_degree=3, ring_degree=2)
    with pytest.raises(ValueError, match="sample 1 has 3 tokens, fewer than the 8 chunks"):
        RingLayout(samples=(SampleShape(tokens=9), SampleShape(tokens=3)), ulysses_degree=1, ring_degree=4,
                   index_in_group=0)


def test_a_ring_needs_its_process_group_and_a_whole_sample_kind() -> None:
    from executor.ring import ring_attention, ring_packed_attention

    layout = _layout(1, 2, 0)
    q = torch.zeros(layout.ring_tokens(0), HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="needs a process group"):
        ring_attention(q, q, q, layout=layout, group=None, causal=True)
    with pytest.raises(ValueError, match="'spatial_2d' cannot run on a ring"):
        ring_packed_attention(q, q, q, layout=layout, group=None, kind="spatial_2d")


def _position(events: list[tuple[str, int, str]], pass_: str, step: int, what: str) -> int:
    found = [i for i, e in enumerate(events) if e == (pass_, step, what)]
    assert len(found) == 1, f"{(pass_, step, what)} recorded {len(found)} times"
    return found[0]


def overlap_problems(events: list[tuple[str, int, str]], ring_degree: int) -> list[str]:
    """Hops not outstanding over the compute they should hide, from one rank's recorded events.

    Forward and backward: the hop of the next key/value block (step ``s < r - 1``) is posted
    before block ``s``'s compute begins and waited for after it ends. Backward: the gradient sum
    posted at step ``s`` is waited for after the next block's compute; the hop home (``s = r - 1``)
    after the last query gradient."""
    def pos(pass_: str, step: int, what: str) -> int:
        return _position(events, pass_, step, what)

    problems = []
    for pass_ in ("forward", "backward"):
        for s in range(ring_degree - 1):
            if not pos(pass_, s, "post kv") < pos(pass_, s, "attend") < pos(pass_, s, "attended") < pos(
                    pass_, s, "wait kv"):
                problems.append(f"{pass_} step {s}: key/value hop not outstanding over the block's compute")
    for s in range(ring_degree):
        hidden = ("backward", s + 1, "attended") if s < ring_degree - 1 else ("backward", s, "dq")
        if not pos("backward", s, "post dkv") < pos(*hidden) < pos("backward", s, "wait dkv"):
            problems.append(f"backward step {s}: gradient hop not outstanding over {hidden[2]} of step {hidden[1]}")
    return problems


@pytest.mark.timeout(240)
def test_backward_hops_overlap_the_compute(ring_results: list[dict[str, object]]) -> None:
    r = 4
    for rank, res in enumerate(ring_results):
        events, sync_events = res["events_True"], res["events_False"]
        assert isinstance(events, list) and isinstance(sync_events, list)
        # r - 1 key/value hops per pass, r gradient hops (the last one home), one compute per block
        for pass_, what, count in (("forward", "post kv", r - 1), ("backward", "post kv", r - 1),
                                   ("backward", "post dkv", r), ("backward", "attend", r)):
            assert sum(1 for e in events if e[0] == pass_ and e[2] == what) == count, (rank, pass_, what)
        assert overlap_problems(events, r) == [], f"rank {rank}"
        # the synchronous schedule fails the same check on every backward hop, not on the forward
        sync = overlap_problems(sync_events, r)
        assert not any(p.startswith("forward") for p in sync)
        assert len(sync) == 2 * r - 1, sync
        # same sums in the same order: the same gradients, bit for bit
        for got, want in zip(res["grads_True"], res["grads_False"], strict=True):  # type: ignore[call-overload]
            assert torch.equal(got, want)
