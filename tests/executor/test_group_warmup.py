"""Every process group the registry creates runs one first collective at start-up, so a windowed
ring whose first transfers only some ranks post runs on NCCL too.

NCCL requires the first call on a group to involve all its ranks when it is a batched p2p
(``torch.distributed.batch_isend_irecv``); a sliding-window ring posts a step's transfers only on
the ranks whose windows reach a block. The registry's own record (``GroupRegistry.warmed_up``)
must hold each group it created with this rank exactly once, and the groups of a world of 4 are
listed here by hand. Then a windowed ring of contiguous chunks runs on the registry's ring group:
on a ring of 4 over a long and a 40-token sample, the 40-token sample's window reaches every
earlier block, so at the third step only positions 0 and 3 post (0 sends to 3); on a ring of 2
position 0 has no remote step at all. Every send has its receive (pairs taken from the ring's
events), and outputs and gradients equal plain windowed attention (fp64). Gloo on 4 CPU ranks;
the same on NCCL with one GPU a rank (skipped without enough GPUs, never faked).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from dcp_cli.net import free_port
from executor.groups import GroupRegistry
from executor.layout import SampleShape
from executor.ring_layout import RingGroups, RingLayout
from planner.plan import GroupPlan
from tests.executor.helpers import gloo_rank, load_rank_results
from tests.executor.window_reference import full_tensors, local_rows, windowed_reference
from tests.executor.worlds import spawn_world

WINDOW = 128
SAMPLES = {  # world: the samples of the ring over the whole world (contiguous chunks)
    2: (SampleShape(tokens=1096), SampleShape(tokens=1040)),
    4: (SampleShape(tokens=1096), SampleShape(tokens=40)),
}
REGISTRY = {  # world: (group sizes, layouts) of the registry
    2: ([1], [(1, 2)]),
    4: ([1, 2], [(1, 4), (2, 2)]),
}
CREATED: dict[int, list[tuple[int, ...]]] = {  # world: the groups the registry creates, in creation order, by hand
    # sizes 2 and 4 (layout (1, 4) is the block of 4; (2, 2)'s Ulysses pairs are blocks of 2),
    # then (2, 2)'s strided rings
    4: [(0, 1), (1, 2), (2, 3), (0, 1, 2, 3), (0, 2), (1, 3)],
    2: [(0, 1)],
}
SECOND = [(2, 1, 2)]
"""An epoch's layouts ``(size, u, r)`` for a second registry (a ring of 2: every block of 2)."""


def _worker(rank: int, world: int, port: int, out_dir: str, backend: str) -> None:
    from executor.ring import record_ring_events, ring_head_to_seq, ring_packed_attention, ring_seq_to_head

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before any NCCL call, as NCCL requires
        device = torch.device("cuda", rank)
    with gloo_rank(rank, world, port, out_dir, backend=backend) as results:
        sizes, layouts = REGISTRY[world]
        registry = GroupRegistry(world_size=world, rank=rank, group_sizes=sizes, layouts=layouts)
        results["num_groups"], results["warmed_up"] = registry.num_groups, list(registry.warmed_up)
        plan = GroupPlan(ranks=list(range(world)), predicted_time_s=0.0, predicted_peak_mem_bytes=0.0,
                         ring_degree=world)
        groups = registry.group_for(plan)
        assert isinstance(groups, RingGroups)
        samples = SAMPLES[world]
        layout = RingLayout(samples=samples, ulysses_degree=1, ring_degree=world, index_in_group=rank,
                            chunking="contiguous")
        q, k, v, g = (local_rows(t, layout).to(device) for t in full_tensors(samples, 0))
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        with record_ring_events() as events:  # the ring group's first use after its warm-up
            qh, kh, vh = (ring_seq_to_head(t, layout, groups) for t in (q, k, v))
            o = ring_packed_attention(qh, kh, vh, layout=layout, group=groups.ring, kind="causal_1d", window=WINDOW)
            out = ring_head_to_seq(o, layout, groups)
            (out * g).sum().backward()
        results["ring"] = tuple(t.detach().cpu() for t in (out, q.grad, k.grad, v.grad) if t is not None)
        results["events"] = list(events)
        registry.group_for(plan)  # handed out again: no second warm-up
        results["warmed_up_after"] = list(registry.warmed_up)
        second = GroupRegistry.from_layouts(world_size=world, rank=rank, layouts=SECOND)
        results["second_num_groups"], results["second_warmed_up"] = second.num_groups, list(second.warmed_up)


def _spawn(world: int, backend: str, out: Path) -> list[dict[str, object]]:
    spawn_world(_worker, args=(world, free_port(), str(out), backend), nprocs=world)
    return load_rank_results(out, world)


def _posted(results: list[dict[str, object]], world: int
            ) -> tuple[Counter[tuple[str, int, str, int, int]], Counter[tuple[str, int, str, int, int]],
                       dict[tuple[str, int], set[int]]]:
    """``(sends, receives, ranks posting)``: every transfer the ranks posted as ``(pass, step,
    kv or dkv, from, to)`` (at step ``k`` position ``j`` sends keys to ``j + k`` and receives them from
    ``j - k``; key gradients go back the other way), and per ``(pass, step)`` the ranks that posted."""
    sends: Counter[tuple[str, int, str, int, int]] = Counter()
    recvs: Counter[tuple[str, int, str, int, int]] = Counter()
    posting: dict[tuple[str, int], set[int]] = {}
    for j, res in enumerate(results):
        events = res["events"]
        assert isinstance(events, list)
        for pass_, step, what in events:
            direction, _, kind = what.partition(" ")
            if direction not in ("send", "recv"):
                continue
            ahead, behind = (j + step) % world, (j - step) % world
            if direction == "send":
                sends[(pass_, step, kind, j, ahead if kind == "kv" else behind)] += 1
            else:
                recvs[(pass_, step, kind, behind if kind == "kv" else ahead, j)] += 1
            posting.setdefault((pass_, step), set()).add(j)
    return sends, recvs, posting


def _check_warm_up(results: list[dict[str, object]], world: int) -> None:
    """Each rank warmed up exactly the created groups it belongs to, once each, in creation order."""
    second = [tuple(range(first, first + 2)) for first in range(world - 1)]
    registries: list[tuple[str, str, list[tuple[int, ...]]]] = [
        ("warmed_up", "num_groups", CREATED[world]), ("second_warmed_up", "second_num_groups", second)]
    for key, num, created in registries:
        counts: Counter[tuple[int, ...]] = Counter()
        for rank, res in enumerate(results):
            assert res[num] == len(created), (rank, key)
            recorded = res[key]
            assert isinstance(recorded, list)
            warmed = [tuple(s) for s in recorded]
            assert warmed == [s for s in created if rank in s], (rank, key)
            counts.update(warmed)
        assert counts == {s: len(s) for s in created}, key  # every group by each of its ranks, once
    for rank, res in enumerate(results):
        assert res["warmed_up_after"] == res["warmed_up"], rank  # running and handing out adds none


def _check_ring(results: list[dict[str, object]], world: int) -> None:
    """The windowed ring equals plain windowed attention; every send has its receive; the first
    transfers involve every rank and, on a ring of 4, a later step only some."""
    want = windowed_reference(SAMPLES[world], WINDOW, False)
    for rank, res in enumerate(results):
        layout = RingLayout(samples=SAMPLES[world], ulysses_degree=1, ring_degree=world, index_in_group=rank,
                            chunking="contiguous")
        got = res["ring"]
        assert isinstance(got, tuple)
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want[:4], strict=True):
            diff = float((g - local_rows(w, layout)).abs().max())
            assert diff <= 1e-10, f"rank {rank}: {what} differs by {diff:.2e}"
    sends, recvs, posting = _posted(results, world)
    assert sends and sends == recvs
    assert posting[("forward", 1)] == set(range(world))  # the ring group's first batch
    attended = [sorted(s for p, s, w in res["events"] if p == "forward" and w == "attend" and s > 0)
                for res in results if isinstance(res["events"], list)]
    if world == 2:
        assert attended == [[], [1]]  # position 0 has no remote step: it only sends
    else:  # the long sample needs the block before, the 40-token one every block before
        assert attended == [[], [1], [1, 2], [1, 2, 3]]
        assert posting[("forward", 3)] == {0, 3} and posting[("backward", 3)] == {0, 3}


@pytest.mark.timeout(240)
def test_every_new_group_runs_one_first_collective_on_gloo(tmp_path: Path) -> None:
    results = _spawn(4, "gloo", tmp_path)
    _check_warm_up(results, 4)
    _check_ring(results, 4)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_windowed_ring_on_nccl_after_the_warm_up(tmp_path: Path, world: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs (NCCL runs one rank a GPU)")
    results = _spawn(world, "nccl", tmp_path)
    _check_warm_up(results, world)
    _check_ring(results, world)
