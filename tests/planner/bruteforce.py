"""Exhaustive optimum of tiny instances, written independently of the planner.

Enumerates every placement (contiguous blocks of allowed sizes, a block no larger than a node
inside one node), every assignment of samples to groups, every split of a group's samples into
micro-batches and every checkpoint policy of every sample, using only the cost model. Dynamic
programming over subsets keeps it exact and fast for up to 8 samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache, partial

import numpy as np

from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.specs import Sample


def placements(num_gpus: int, gpus_per_node: int, sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Every ordered split of ranks ``0..N-1`` into contiguous allowed blocks (size, first)."""
    out: list[list[tuple[int, int]]] = []

    def rec(start: int, acc: list[tuple[int, int]]) -> None:
        if start == num_gpus:
            out.append(list(acc))
            return
        for d in sizes:
            if start + d > num_gpus:
                continue
            if d <= gpus_per_node and nodes_spanned(first_rank=start, group_size=d,
                                                    gpus_per_node=gpus_per_node) > 1:
                continue
            acc.append((d, start))
            rec(start + d, acc)
            acc.pop()

    rec(0, [])
    return out


def best_split_s(mask: int, block_time: Callable[[int], float], memo: dict[int, float]) -> float:
    """Least time of a group running the samples of ``mask`` (a bit set) in any split into
    micro-batches, ``block_time(block)`` the best time of one micro-batch holding ``block``;
    ``memo`` caches it per mask (one dict per group setting)."""
    if mask == 0:
        return 0.0
    if mask in memo:
        return memo[mask]
    low = mask & -mask
    rest = mask ^ low
    best = float("inf")
    sub = rest
    while True:  # the block holding the lowest sample: low plus any subset of the rest
        block = low | sub
        t = block_time(block)
        if t < best:
            best = min(best, t + best_split_s(mask ^ block, block_time, memo))
        if sub == 0:
            break
        sub = (sub - 1) & rest
    memo[mask] = best
    return best


def best_makespan_s(num_samples: int, groups: Sequence[Callable[[int], float]]) -> float:
    """Least makespan of running every sample once on the given groups, ``groups[g](mask)`` the
    best time of group ``g`` running the samples of ``mask`` (inf when it cannot): dynamic
    programming over the subsets run so far."""
    full = (1 << num_samples) - 1
    dp = {0: 0.0}  # samples run so far -> least makespan of the groups so far
    for group_time in groups:
        nxt: dict[int, float] = {}
        for mask, value in dp.items():
            free = full ^ mask
            sub = free
            while True:
                t = max(value, group_time(sub))
                if t < nxt.get(mask | sub, float("inf")):
                    nxt[mask | sub] = t
                if sub == 0:
                    break
                sub = (sub - 1) & free
        dp = nxt
    return dp.get(full, float("inf"))


def optimum_step_time_s(samples: Sequence[Sample], cost_model: CostModel, sizes: Sequence[int]
                        ) -> float:
    """The least predicted step time over all plans (inf if the batch cannot be planned)."""
    n = len(samples)
    layers = cost_model.num_layers
    cap = cost_model.cluster.memory_cap_bytes

    ks = np.arange(layers + 1)

    @cache
    def sample_costs(i: int, d: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
        """Time and activation bytes of sample ``i`` under every policy ``k = 0..L``."""
        s = samples[i]
        t = cost_model.sample_time_s(s.tokens, group_size=d, recompute_layers=ks,
                                     frames=s.num_frames, spatial=s.spatial_tokens, num_nodes=nodes)
        a = cost_model.activation_bytes(s.tokens, group_size=d, recompute_layers=ks)
        return np.asarray(t, dtype=np.float64), np.asarray(a, dtype=np.float64)

    @cache
    def block_time(mask: int, d: int, nodes: int) -> float:
        """Best time of one micro-batch holding the samples of ``mask`` (every policy tried).

        A micro-batch costs its samples' times plus the fixed overhead and one call of every
        layer per pass, two where its policies differ at that layer and one more forward per
        recomputed layer; its peak is the fixed bytes plus its samples' activations
        (``CostModel.microbatch_time_s`` / ``_peak_bytes``).
        """
        members = [i for i in range(n) if mask >> i & 1]
        total_t = np.zeros(())
        total_a = np.zeros(())
        k_max = np.zeros((), dtype=np.int64)
        k_min = np.full((), layers, dtype=np.int64)
        for i in members:  # outer sums over every combination of policies
            t, a = sample_costs(i, d, nodes)
            total_t = np.add.outer(total_t, t)
            total_a = np.add.outer(total_a, a)
            k_max = np.maximum.outer(k_max, ks)
            k_min = np.minimum.outer(k_min, ks)
        call_f, call_b = cost_model.layer_call_s(group_size=d, num_nodes=nodes)
        mixed_layers = np.array([sum(1 for lay in range(layers) if lo <= lay < hi)
                                 for lo, hi in zip(k_min.ravel(), k_max.ravel(), strict=True)]
                                ).reshape(k_max.shape)
        fixed = (cost_model.file.compute.microbatch_overhead_s
                 + (layers + mixed_layers) * (call_f + call_b) + k_max * call_f)
        total_t = total_t + fixed
        ok = cost_model.fixed_bytes() + total_a <= cap
        if not ok.any():
            return float("inf")
        return float(total_t[ok].min())

    memos: dict[tuple[int, int], dict[int, float]] = {}

    def group_time(mask: int, d: int, nodes: int) -> float:
        """Best time of a group running the samples of ``mask`` in any micro-batch split."""
        return best_split_s(mask, lambda block: block_time(block, d, nodes), memos.setdefault((d, nodes), {}))

    gpn = cost_model.cluster.gpus_per_node
    best = float("inf")
    seen: set[tuple[tuple[int, int], ...]] = set()
    for placement in placements(cost_model.cluster.num_gpus, gpn, sizes):
        shape = tuple(sorted((d, nodes_spanned(first_rank=f, group_size=d, gpus_per_node=gpn))
                             for d, f in placement))
        if shape in seen:
            continue  # same group sizes and node spans cost the same
        seen.add(shape)
        best = min(best, best_makespan_s(n, [partial(group_time, d=d, nodes=nodes) for d, nodes in shape]))
    return best + cost_model.grad_sync_time_s()
