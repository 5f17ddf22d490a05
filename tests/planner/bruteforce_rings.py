"""Exhaustive optimum of tiny instances whose groups may run rings, written independently of the planner.

Enumerates every placement (contiguous blocks of the given sizes, a block no larger than a node
inside one node), every attention layout of every group (a ring degree from the given options:
Ulysses over ``size / r`` ranks x ring over ``r``), every assignment of samples to groups, every
split of a group's samples into micro-batches and every checkpoint policy of every sample. Each
micro-batch is priced by the cost model alone (``CostModel.microbatch_time_s`` and
``microbatch_peak_bytes`` at the group's layout on its ranks: a ring's exposed transfer is per
micro-batch, not per sample), a sample of fewer than ``2 r`` tokens cannot run on a ring of ``r``
(the zig-zag cuts it into ``2 r`` chunks). Dynamic programming over subsets of samples keeps it
exact (the placements and the two subset recursions are ``tests/planner/bruteforce.py``'s, which
use the cost model alone too); meant for up to 5 samples, 4 ranks and 2 layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from functools import cache, partial

from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.specs import Sample
from tests.planner.bruteforce import best_makespan_s, best_split_s, placements


def optimum_with_rings_s(samples: Sequence[Sample], cost_model: CostModel,
                         ring_degrees: Mapping[int, Sequence[int]]) -> float:
    """The least predicted step time over every plan whose group of size ``d`` runs one of
    ``ring_degrees[d]`` (1: pure Ulysses); inf when no plan holds the batch."""
    n = len(samples)
    layers = cost_model.num_layers
    cap = cost_model.cluster.memory_cap_bytes
    gpn = cost_model.cluster.gpus_per_node

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

    memos: dict[tuple[int, int, int], dict[int, float]] = {}

    def group_time(mask: int, d: int, first: int) -> float:
        """Best time of a group running the samples of ``mask``: any layout, any micro-batch split."""
        return min(best_split_s(mask, partial(block_time, d=d, first=first, r=r), memos.setdefault((d, first, r), {}))
                   for r in ring_degrees[d])

    best = float("inf")
    for placement in placements(cost_model.cluster.num_gpus, gpn, sorted(ring_degrees)):
        best = min(best, best_makespan_s(n, [partial(group_time, d=d, first=first) for d, first in placement]))
    return best + cost_model.grad_sync_time_s()
