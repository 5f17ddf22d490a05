"""Ring attention on gloo equals plain attention over each whole sample (fp64), forward and backward.

4 ranks, one ring of 4 and then two rings of 2; packed micro-batches of samples of uneven lengths
(some shorter than the ring, so some ranks hold no token of them); causal (1D) and non-causal
(3D video). The reference is per-sample softmax attention on the whole tensors in one process;
the gradients of q, k and v reach the rank that owns each token through the reverse ring."""

from __future__ import annotations

import math
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_cli.net import free_port
from executor.layout import PackedLayout, SampleShape
from tests.executor.helpers import init_gloo

WORLD = 4
SAMPLES = (SampleShape(tokens=11, frames=1), SampleShape(tokens=3, frames=1), SampleShape(tokens=8, frames=2))
HEADS, HEAD_DIM = 2, 4


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


def _pieces(full: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    offsets = layout.sample_offsets()
    return torch.cat([full[offsets[s]:offsets[s + 1]][slice(*layout.piece_range(s))] for s in range(len(SAMPLES))])


def _worker(rank: int, port: int, out_dir: str) -> None:
    from executor.ring import ring_attention

    init_gloo(rank, WORLD, port)
    results: dict[str, object] = {}
    try:
        rings = {4: [dist.new_group([0, 1, 2, 3])], 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
        for size in (4, 2):
            group = rings[size][rank // size]
            layout = PackedLayout(samples=SAMPLES, group_size=size, index_in_group=rank % size)
            for causal in (True, False):
                q, k, v, g = (_pieces(t, layout) for t in _full_tensors(0))
                q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
                out = ring_attention(q, k, v, layout=layout, group=group, causal=causal)
                (out * g).sum().backward()
                results[f"{size}_{causal}"] = (out.detach(), q.grad, k.grad, v.grad)
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp("ring"))
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    loaded = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    for r, res in enumerate(loaded):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return loaded


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_whole_sample_attention(ring_results: list[dict[str, object]], size: int,
                                                      causal: bool) -> None:
    want = _reference(causal)
    assert float(want[2].abs().max()) > 1e-3  # a real key gradient
    for rank, res in enumerate(ring_results):
        layout = PackedLayout(samples=SAMPLES, group_size=size, index_in_group=rank % size)
        got = res[f"{size}_{causal}"]
        assert isinstance(got, tuple)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            expected = _pieces(w, layout)
            diff = float((g - expected).abs().max()) / float(w.abs().max())
            assert diff <= 1e-12, f"rank {rank}, ring of {size}, causal={causal}: {name} differs by {diff:.2e}"


def test_a_ring_needs_its_process_group() -> None:
    from executor.ring import ring_attention

    layout = PackedLayout(samples=SAMPLES, group_size=2, index_in_group=0)
    q = torch.zeros(layout.local_tokens, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="needs a process group"):
        ring_attention(q, q, q, layout=layout, group=None, causal=True)
