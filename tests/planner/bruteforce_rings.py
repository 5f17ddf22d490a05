"""Exhaustive optimum of tiny instances whose groups may run rings, written independently of the planner.

Enumerates every placement (contiguous blocks of the given sizes, a block no larger than a node
inside one node), every attention layout of every group (a ring degree from the given options:
Ulysses over ``size / r`` ranks x ring over ``r``), every assignment of samples to groups, every
split of a group's samples into micro-batches and every checkpoint policy of every sample. Each
micro-batch is priced by the cost model alone (``CostModel.microbatch_time_s`` and
``microbatch_peak_bytes`` at the group's layout on its ranks: a ring's exposed transfer is per
micro-batch, not per sample), a sample of fewer than ``2 r`` tokens cannot run on a ring of ``r``
(the zig-zag cuts it into ``2 r`` chunks). Dynamic programming over subsets of samples keeps it
exact; meant for up to 5 samples, 4 ranks and 2 layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from functools import cache

from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.specs import Sample


def _blocks(num_gpus: int, gpus_per_node: int, sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Every split of ranks ``0..N-1`` into contiguous blocks ``(size, first rank)``."""
    out: list[list[tuple[int, int]]] = []

    def rec(start: int, acc: list[tuple[int, int]]) -> None:
        if start == num_gpus:
            out.append(list(acc))
            return
        for d in sizes:
            if start + d > num_gpus:
                continue
            if d <= gpus_per_node and (start // gpus_per_node) != ((start + d - 1) // gpus_per_node):
                continue
            rec(start + d, [*acc, (d, start)])

    rec(0, [])
    return out


def optimum_with_rings_s(samples: Sequence[Sample], cost_model: CostModel,
                         ring_degrees: Mapping[int, Sequence[int]]) -> float:
    """The least predicted step time over every plan whose group of size ``d`` runs one of
    ``ring_degrees[d]`` (1: pure Ulysses); inf when no plan holds the batch."""
    n = len(samples)
    layers = cost_model.num_layers
    cap = cost_model.cluster.memory_cap_bytes
    gpn = cost_model.cluster.gpus_per_node
    full = (1 << n) - 1

    @cache
    def block_time(mask: int, d: int, first: int, r: int) -> float:
        """Best time of one micro-batch of the samples of ``mask`` on ranks ``first..first+d-1``
        under ring degree ``r``, over every combination of policies that fits the cap."""
        members = [samples[i] for i in range(n) if mask >> i & 1]
        if r > 1 and any(s.tokens < 2 * r for s in members):
            return float("inf")
        layout = None if r == 1 else cost_model.place(first_rank=first, group_size=d, ring_degree=r)
        nodes = nodes_spanned(first_rank=first, group_size=d, gpus_per_node=gpn)
        best = float("inf")
        for ks in itertools.product(range(layers + 1), repeat=len(members)):
            if cost_model.microbatch_peak_bytes(members, group_size=d, recompute_layers=list(ks),
                                                layout=layout) > cap:
                continue
            best = min(best, cost_model.microbatch_time_s(members, group_size=d, recompute_layers=list(ks),
                                                          num_nodes=nodes, layout=layout))
        return best

    @cache
    def group_time(mask: int, d: int, first: int, r: int) -> float:
        """Best time of a group running the samples of ``mask`` in any split into micro-batches."""
        if mask == 0:
            return 0.0
        low = mask & -mask
        rest = mask ^ low
        best = float("inf")
        sub = rest
        while True:  # the micro-batch holding the lowest sample: it plus any subset of the rest
            block = low | sub
            t = block_time(block, d, first, r)
            if t < best:
                best = min(best, t + group_time(mask ^ block, d, first, r))
            if sub == 0:
                break
            sub = (sub - 1) & rest
        return best

    best = float("inf")
    for placement in _blocks(cost_model.cluster.num_gpus, gpn, sorted(ring_degrees)):
        dp = {0: 0.0}  # samples run so far -> least makespan of the groups so far
        for d, first in placement:
            nxt: dict[int, float] = {}
            for mask, value in dp.items():
                free = full ^ mask
                sub = free
                while True:
                    t = max(value, min(group_time(sub, d, first, r) for r in ring_degrees[d]))
                    if t < nxt.get(mask | sub, float("inf")):
                        nxt[mask | sub] = t
                    if sub == 0:
                        break
                    sub = (sub - 1) & free
            dp = nxt
        best = min(best, dp.get(full, float("inf")))
    return best + cost_model.grad_sync_time_s()
