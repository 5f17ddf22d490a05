"""``dcp-greedy``: the scheduler published with DCP (DCP-inter; docs/planner.md), seeded.

* Profile: for every shape bucket (``common.shape_buckets``) the ``(SP size, batch size)`` pair
  with the most samples per GPU-second that fits memory, as DCP profiles each bucket: SP sizes
  are powers of two within one node (DCP's limit; larger only for a bucket that fits none),
  the batch is costed on the bucket's largest sample with the cheapest policy under which the
  whole batch fits (the paper's profile tables, here from the cost model).
* Random greedy group fill with accumulation counts toward a common target: each bucket is
  cut into batches of its profiled size (sampler order); the target is the batch's GPU-seconds
  over ``N``; while ranks are free, a random bucket (weighted by its GPU-seconds still
  unassigned) gets a group of its SP size running the accumulation count of its batches whose
  time is nearest the target, an over-shoot weighing 1.2 times an under-shoot (the paper's
  target search). Ranks no bucket fits stay idle. Batches left when the ranks run out go to the
  least-loaded group of their bucket's size (or, if none, to the least-loaded group that holds
  them, profiled again at its size).

Deviation from the paper, in the baseline's favour: the global batch is exactly the sampler's
(no sample is dropped and no minimum accumulation count inflates it).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import numpy as np

from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.common import place_layout, shape_buckets
from planner.costs import CostTable

OVERSHOOT_PENALTY = 1.2
"""Weight of time over the target against time under it (the paper's target search)."""


@dataclass(frozen=True, slots=True)
class BucketProfile:
    """A bucket's profiled batch at one SP size."""

    group_size: int
    batch_size: int
    recompute_layers: int
    batch_time_s: float

    @property
    def samples_per_gpu_s(self) -> float:
        """Throughput the profile is chosen by."""
        return self.batch_size / (self.batch_time_s * self.group_size)


def largest_samples(table: CostTable, buckets: list[list[int]]) -> list[Sample]:
    """Each bucket's sample of most tokens (the first of them on ties)."""
    samples = table.samples
    tokens = table.classes.tokens[table.classes.class_of]  # every sample's, through its class
    # np.argmax: the first of the most tokens, as max() over the members in order.
    return [samples[members[int(np.argmax(tokens[members]))]] for members in buckets]


def profile_buckets(table: CostTable, buckets: list[list[int]], *, group_size: int,
                    fixed_s: dict[int, np.ndarray] | None = None,
                    reps: list[Sample] | None = None) -> list[BucketProfile | None]:
    """The best batch of each bucket on ``group_size`` ranks (None where one sample does not
    fit): the cost model evaluated for every bucket's largest sample and policy at once.

    ``fixed_s`` caches the micro-batch fixed seconds per policy ``0..L-1`` by size; ``reps``:
    ``largest_samples(table, buckets)`` when the caller has them.
    """
    cm = table.cost_model
    if reps is None:
        reps = largest_samples(table, buckets)
    ks = np.arange(max(cm.num_layers, 1))  # 0..L-1 (L is dominated by L-1)
    tokens = np.array([[s.tokens] for s in reps], dtype=np.float64).reshape(-1, 1)
    layout = table.layout_of(group_size)  # the size's layout in the table, which its groups run
    act = np.asarray(cm.activation_bytes(tokens, group_size=group_size, recompute_layers=ks, layout=layout))
    each = np.asarray(cm.sample_time_s(
        tokens, group_size=group_size, recompute_layers=ks, layout=layout,
        frames=np.array([[s.num_frames] for s in reps], dtype=np.float64).reshape(-1, 1),
        spatial=np.array([[s.spatial_tokens] for s in reps], dtype=np.float64).reshape(-1, 1)))
    fixed = None if fixed_s is None else fixed_s.get(group_size)
    if fixed is None:
        # CostModel.microbatch_fixed_s with one policy k throughout: the overhead, L layer calls
        # and k recompute calls (the table holds its parts per size).
        j = table.size_index(group_size)
        fixed = (table.microbatch_base_s + table.num_layers * float(table.call_s_by_size[j])
                 + ks * float(table.call_fwd_s_by_size[j]))
        if fixed_s is not None:
            fixed_s[group_size] = fixed
    budget = table.budget_bytes
    out: list[BucketProfile | None] = []
    for row, members in enumerate(buckets):
        act_r, each_r = act[row], each[row]
        least = float(act_r.min())
        most = min(int(budget // least) if least > 0 else len(members), len(members))
        if most < 1:
            out.append(None)
            continue
        batch = np.arange(1, most + 1)
        # Cheapest k: bytes fall with k, so k is the count of policies that do not fit.
        k = (act_r[None, :] * batch[:, None] > budget).sum(axis=1)
        k = np.minimum(k, len(ks) - 1)
        t = fixed[k] + batch * each_r[k]
        b = int(np.argmax(batch / t))
        out.append(BucketProfile(group_size=group_size, batch_size=int(batch[b]),
                                 recompute_layers=int(ks[k[b]]), batch_time_s=float(t[b])))
    return out


def best_profiles(table: CostTable, buckets: list[list[int]], *,
                  fixed_s: dict[int, np.ndarray] | None = None,
                  largest: list[Sample] | None = None) -> list[BucketProfile | None]:
    """Each bucket's profile over the power-of-two sizes within a node (any, if none fits);
    ``largest``: ``largest_samples(table, buckets)`` when the caller has them."""
    pow2 = [d for d in table.sizes if d & (d - 1) == 0]
    gpn = table.cost_model.cluster.gpus_per_node
    best: list[BucketProfile | None] = [None] * len(buckets)
    todo = list(range(len(buckets)))
    if largest is None:
        largest = largest_samples(table, buckets)
    for sizes in ([d for d in pow2 if d <= gpn], [d for d in pow2 if d > gpn]):
        if not todo:
            break
        found: list[list[BucketProfile]] = [[] for _ in todo]
        reps = [largest[b] for b in todo]
        for d in sizes:
            for pos, p in enumerate(profile_buckets(table, [buckets[b] for b in todo],
                                                    group_size=d, fixed_s=fixed_s, reps=reps)):
                if p is not None:
                    found[pos].append(p)
        for pos, b in enumerate(todo):
            if found[pos]:
                best[b] = max(found[pos], key=lambda p: (p.samples_per_gpu_s, -p.group_size))
        todo = [b for b in todo if best[b] is None]
    return best


def accumulation_count(batch_time_s: float, target_s: float, *, available: int) -> int:
    """DCP's accumulation count: the count whose ``time * count`` is nearest the target, an
    over-shoot weighing ``OVERSHOOT_PENALTY`` times an under-shoot (at least 1, at most
    ``available``)."""
    low = max(1, min(available, math.floor(target_s / batch_time_s)))
    high = min(available, low + 1)

    def miss(count: int) -> float:
        over = count * batch_time_s - target_s
        return over * OVERSHOOT_PENALTY if over > 0 else -over

    return low if miss(low) <= miss(high) else high


def dcp_greedy_draft(table: CostTable, *, seed: int = 0,
                     reference: Sample | None = None) -> Draft | None:
    """The DCP-inter draft (None when a bucket fits no size).

    Args:
        table: The batch's cost table.
        seed: Seed of the random group fill.
        reference: Unused (the registry's signature).
    """
    del reference
    rng = random.Random(seed)
    buckets = shape_buckets(table)
    fixed_s: dict[int, np.ndarray] = {}
    profiles: list[BucketProfile] = []
    largest = largest_samples(table, buckets)
    for p in best_profiles(table, buckets, fixed_s=fixed_s, largest=largest):
        if p is None:
            return None
        profiles.append(p)
    # Batches of every bucket, in sampler order: (bucket, sample indices).
    pending = [[members[a:a + p.batch_size] for a in range(0, len(members), p.batch_size)]
               for members, p in zip(buckets, profiles, strict=True)]
    work_s = [len(c) * p.batch_time_s * p.group_size for c, p in zip(pending, profiles, strict=True)]
    target_s = sum(work_s) / table.cost_model.cluster.num_gpus
    free = table.cost_model.cluster.num_gpus
    owner: list[int] = []  # bucket of every group
    assigned: list[list[list[int]]] = []  # batches of every group
    loads: list[float] = []
    # Each bucket's batches are taken from the front: head[b] of them are gone (advancing an
    # index, not slicing the rest off the list each time, which was quadratic in a bucket's size).
    head = [0] * len(buckets)
    while True:
        eligible = [b for b in range(len(buckets))
                    if head[b] < len(pending[b]) and profiles[b].group_size <= free]
        if not eligible:
            break
        b = rng.choices(eligible, weights=[(len(pending[e]) - head[e]) * profiles[e].batch_time_s
                                           * profiles[e].group_size for e in eligible])[0]
        p = profiles[b]
        count = accumulation_count(p.batch_time_s, target_s, available=len(pending[b]) - head[b])
        owner.append(b)
        assigned.append(pending[b][head[b]:head[b] + count])
        loads.append(count * p.batch_time_s)
        head[b] += count
        free -= p.group_size
    pending = [batches[start:] for batches, start in zip(pending, head, strict=True)]
    sizes = [profiles[b].group_size for b in owner]
    # Batches left when the ranks ran out: to the least-loaded group of the bucket's size, or
    # (none) to the least-loaded group that holds the bucket, profiled again at its size.
    policies: list[dict[int, int]] = [{} for _ in owner]  # per group: bucket -> policy
    for g, b in enumerate(owner):
        policies[g][b] = profiles[b].recompute_layers
    for b in range(len(buckets)):
        if not pending[b]:
            continue
        same = [g for g, d in enumerate(sizes) if d == profiles[b].group_size]
        if same:
            # The least-loaded group of the size (ties: the lower index) from a heap.
            heap = [(loads[g], g) for g in same]
            heapq.heapify(heap)
            for batch in pending[b]:
                g = heap[0][1]
                assigned[g].append(batch)
                policies[g][b] = profiles[b].recompute_layers
                loads[g] += profiles[b].batch_time_s
                heapq.heapreplace(heap, (loads[g], g))
            continue
        # The bucket's profile at each size in use (the same for every group of a size).
        at_size = {d: profile_buckets(table, [buckets[b]], group_size=d, fixed_s=fixed_s,
                                      reps=[largest[b]])[0] for d in sorted(set(sizes))}
        options = [(loads[g], g, q) for g, d in enumerate(sizes)
                   if (q := at_size[d]) is not None]
        if not options:
            return None
        _, g, q = min(options, key=lambda o: (o[0], o[1]))
        members = [i for batch in pending[b] for i in batch]
        for a in range(0, len(members), q.batch_size):
            assigned[g].append(members[a:a + q.batch_size])
            loads[g] += q.batch_time_s
        policies[g][b] = q.recompute_layers
    groups = place_layout(sizes, table)
    if groups is None:
        return None
    bucket_of = {i: b for b, members in enumerate(buckets) for i in members}
    for g in range(len(sizes)):
        groups[g].micro_batches = [[(i, policies[g][bucket_of[i]]) for i in batch]
                                   for batch in assigned[g]]
    return groups
