"""The fast heuristic: candidate group-size multisets, LPT assignment, local search.

1. Candidate multisets of group sizes that partition the world: for a few target makespans
   ``T`` around the deadline-area bound, each sample class picks its most efficient size that
   meets ``T`` (as in the bound); the work per size becomes a number of groups, rounded by
   largest remainders and repaired to sum to ``N``. Uniform multisets (all groups one size)
   are added, so the search always contains the fixed-size plans.
2. LPT: samples in decreasing work order go to the group where they finish earliest; each group
   packs its samples first-fit into micro-batches under the memory cap, each sample at its
   cheapest fitting policy, and pays the micro-batch overhead per micro-batch it opens.
   Near-equal samples (work within ``bucket_tolerance``, as FlexSP's buckets) are placed in
   bulk runs, each at its own exact cost; the group choice runs on plain lists (a few dozen
   groups, where numpy's per-call cost dominated the profile).
3. Bisection on the target makespan of an on-demand packing (``multisets.packed_multiset``),
   whose multisets get the LPT too, and on the LPT target for the best multisets.
4. Local search on the best candidates (``local_search``): move or swap samples off the
   slowest group while that lowers the makespan, then repack each group first-fit-decreasing.

Everything is deterministic (sorted orders, index tie-breaks); limits are move counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from planner.assemble import Draft, DraftGroup
from planner.costs import CostTable
from planner.placement import place_groups
from planner.search.intra import intra_layout
from planner.search.local_search import GroupState, local_search, repack
from planner.search.multisets import candidate_multisets, packed_multiset
from planner.search.resize import resize_search

logger = logging.getLogger(__name__)


def _order(table: CostTable) -> list[int]:
    """Samples by decreasing work (most efficient GPU-seconds), ties by index."""
    sizes = np.asarray(table.sizes, dtype=np.float64)
    work = np.min(table.time_s * sizes[None, :], axis=1)
    cls = table.classes.class_of
    return sorted(range(len(cls)), key=lambda i: (-work[cls[i]], i))


def bucket_runs(table: CostTable, order: list[int], *, tolerance: float) -> list[int]:
    """End positions of runs of near-equal samples in ``order`` (decreasing work).

    A run starts at a sample and takes the following ones while their work (most efficient
    GPU-seconds) is within ``tolerance`` of the first's and their fitting sizes are the same:
    the search assigns a run in bulk (as FlexSP buckets near-equal sequences), while every
    sample keeps its exact cost. ``tolerance=0`` gives runs of identical samples only.
    """
    sizes = np.asarray(table.sizes, dtype=np.float64)
    work: list[float] = np.min(table.time_s * sizes[None, :], axis=1).tolist()
    fits = [tuple(row) for row in np.isfinite(table.time_s).tolist()]
    cls = table.classes.class_of
    ends: list[int] = []
    pos = 0
    while pos < len(order):
        c0 = cls[order[pos]]
        floor = work[c0] * (1.0 - tolerance)
        end = pos + 1
        while end < len(order):
            c = cls[order[end]]
            if c != c0 and (tolerance <= 0 or work[c] < floor or fits[c] != fits[c0]):
                break
            end += 1
        ends.append(end)
        pos = end
    return ends


@dataclass(slots=True)
class _Layout:
    """Groups of one multiset with per-class cost rows gathered per group (class x group)."""

    groups: list[GroupState]
    time_s: np.ndarray
    mem_bytes: np.ndarray
    area_rank: np.ndarray
    """Rank of each group's size by the class's GPU-seconds on it (0: most efficient)."""


def _layout(table: CostTable, multiset: list[int]) -> _Layout | None:
    cluster = table.cost_model.cluster
    placed = place_groups(multiset, num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node)
    if placed is None:
        return None
    groups = [GroupState(size=d, col=table.size_index(d), first_rank=r) for d, r in placed]
    cols = np.array([g.col for g in groups], dtype=np.int64)
    sizes = np.asarray(table.sizes, dtype=np.float64)
    area = table.time_s * sizes[None, :]
    rank = np.argsort(np.argsort(area, axis=1, kind="stable"), axis=1, kind="stable")
    return _Layout(groups=groups, time_s=table.time_s[:, cols], mem_bytes=table.mem_bytes[:, cols],
                   area_rank=rank[:, cols].astype(np.float64))


def lpt(table: CostTable, multiset: list[int], order: list[int], *, target_s: float | None = None,
        strict: bool = False, runs: list[int] | None = None) -> list[GroupState] | None:
    """Assign samples to the groups of a multiset.

    Without a target: earliest finish first (LPT). With a target makespan: among the groups
    where the sample finishes by the target, the one that runs it in the fewest GPU-seconds
    (then the fullest: best fit); earliest finish when no group meets the target. Each group
    fills its last micro-batch until the next sample does not fit, then opens another.
    ``strict`` gives up (None) as soon as a sample cannot meet the target. ``runs`` (from
    ``bucket_runs``; default: runs of identical samples) are placed in bulk: the group chosen
    for a run's next sample keeps taking the run's following samples, each at its own exact
    cost, while the per-sample rule would still choose it had they been copies.
    """
    layout = _layout(table, multiset)
    if layout is None:
        return None
    groups = layout.groups
    num_groups = len(groups)
    cls = table.classes.class_of
    budget = table.budget_bytes
    o_g: list[float] = table.overhead_s_by_size[[g.col for g in groups]].tolist()
    # Plain lists: per sample, a few operations on a few dozen groups, where numpy's per-call
    # cost would dominate. Same arithmetic and tie-breaks (first index) as the vector form.
    load = [0.0] * num_groups
    free = [-1.0] * num_groups  # free bytes of each group's open micro-batch
    scale = 4.0 * (target_s or 1.0) + 1.0  # key = area rank * scale - finish orders both
    keys: list[list[float]] = (layout.area_rank * scale).tolist()
    inf = np.inf
    if runs is None:
        runs = bucket_runs(table, order, tolerance=0.0)
    time_s: list[list[float]] = layout.time_s.tolist()
    mem_bytes: list[list[float]] = layout.mem_bytes.tolist()
    span = range(num_groups)
    pos = 0
    for end in runs:
        while pos < end:
            c = cls[order[pos]]
            m_row, t_row = mem_bytes[c], time_s[c]
            finish = [load[g] + t_row[g] + (o_g[g] if free[g] < m_row[g] else 0.0) for g in span]
            gi = -1
            limit = inf
            if target_s is not None:
                key_row = keys[c]
                best_key = inf
                for g in span:
                    f = finish[g]
                    if f <= target_s and key_row[g] - f < best_key:
                        best_key, gi = key_row[g] - f, g
                if gi < 0:
                    if strict:
                        return None
                else:
                    limit = target_s
            if gi < 0:
                best1 = best2 = inf
                for g in span:
                    f = finish[g]
                    if f < best1:
                        best1, best2, gi = f, best1, g
                    elif f < best2:
                        best2 = f
                if gi < 0:
                    return None
                if end - pos > 1 and num_groups > 1:
                    limit = best2
            g_state = groups[gi]
            ld, fr, o = load[gi], free[gi], o_g[gi]
            first = True
            while pos < end:
                i = order[pos]
                ci = cls[i]
                t, m = time_s[ci][gi], mem_bytes[ci][gi]
                opens = fr < m
                nxt = ld + t + (o if opens else 0.0)
                if not first and (nxt > limit or t == inf):
                    break
                first = False
                if opens:
                    fr = budget - m
                    g_state.mbs.append([i])
                    g_state.free_bytes.append(fr)
                else:
                    fr -= m
                    g_state.mbs[-1].append(i)
                    g_state.free_bytes[-1] = fr
                ld = nxt
                pos += 1
            load[gi], free[gi] = ld, fr
    for gi, state in enumerate(groups):
        state.load_s = float(load[gi])
    return groups


def to_draft(table: CostTable, groups: list[GroupState]) -> Draft:
    """The groups as a draft: each sample at its cheapest fitting policy in the groups'
    micro-batches, or with ``table.intra_policies`` the best split and policies per group
    (``intra.intra_layout``)."""
    cls = table.classes.class_of
    draft: Draft = []
    for g in groups:
        if table.intra_policies:
            mbs = intra_layout(table, g.col, [i for mb in g.mbs for i in mb])[1]
            mbs = [sorted(mb) for mb in mbs]
        else:
            mbs = [[(i, int(table.k_min[cls[i], g.col])) for i in sorted(mb)] for mb in g.mbs]
        draft.append(DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=mbs))
    return draft


def heuristic_plan(table: CostTable, *, makespan_hint_s: float, num_candidates: int,
                   num_lpt_runs: int, max_moves: int, num_refined: int = 2,
                   num_target_probes: int = 4, bucket_tolerance: float = 0.0,
                   max_ejections: int = 0, max_resizes: int = 0, deep_min_gap: float = 0.0
                   ) -> tuple[Draft, list[list[int]]]:
    """The heuristic's best draft and the multisets it tried.

    Args:
        table: Costs of the batch.
        makespan_hint_s: A target compute makespan (the tightest lower bound).
        num_candidates: Most multisets to generate.
        num_lpt_runs: Most (multiset, target) LPT runs, in order of promise: every multiset
            with no target and with the bound as target, then the looser targets.
        max_moves: Local-search moves per refined candidate.
        num_refined: How many of the best multisets get the target bisection, and how many of
            the best results the local search.
        num_target_probes: Bisection steps on the target makespan per refined multiset.
        bucket_tolerance: Relative work difference up to which consecutive samples form one
            run that the LPT and the on-demand packing place in bulk (``bucket_runs``); the
            local search and every cost stay exact per sample.
        max_ejections: One-for-many swaps per refined candidate when the local search's moves
            and swaps are stuck (``local_search``).
        max_resizes: Split / merge candidates tried on the best result (``resize_search``).
        deep_min_gap: Ejections and resize moves run only on results whose makespan is over
            ``makespan_hint_s * (1 + deep_min_gap)``.

    Raises:
        ValueError: when no multiset of allowed sizes can hold the batch.
    """
    # Work limits are sized for 256 samples; larger batches get proportionally fewer runs
    # (never fewer than 4), so a budget preset stays near its budget at 1024 samples.
    num_lpt_runs = max(min(num_lpt_runs, 4),
                       round(num_lpt_runs * min(1.0, 256 / max(len(table.samples), 1))))
    # Only as many multisets as the LPT runs can use (two runs each, then uniform ones).
    multisets = candidate_multisets(table, makespan_s=makespan_hint_s,
                                    limit=min(num_candidates, max(2, num_lpt_runs // 2 + 1)))
    if not multisets:
        raise ValueError(
            f"no partition of {table.cost_model.cluster.num_gpus} ranks into groups of sizes "
            f"{table.sizes} (nodes of {table.cost_model.cluster.gpus_per_node}) can hold the batch")
    order = _order(table)
    bucketed = bucket_runs(table, order, tolerance=bucket_tolerance)
    runs: list[tuple[list[int], float | None]] = []
    for factors in ((None, 1.0), (1.03, 1.07, 1.15)):
        for ms in multisets:
            runs.extend((ms, None if f is None else makespan_hint_s * f) for f in factors)
    scored: list[tuple[float, int, list[GroupState]]] = []
    for idx, (ms, target) in enumerate(runs[:max(1, num_lpt_runs)]):
        groups = lpt(table, ms, order, target_s=target, runs=bucketed)
        if groups is not None:
            scored.append((max(g.load_s for g in groups), idx, groups))
    if not scored:  # every sample fits the largest size, so the largest uniform multiset works
        for idx, (ms, target) in enumerate(runs):
            groups = lpt(table, ms, order, target_s=target, runs=bucketed)
            if groups is not None:
                scored.append((max(g.load_s for g in groups), idx, groups))
                break
    if not scored:
        raise ValueError(f"no candidate partition of the world can hold every sample "
                         f"(sizes {table.sizes})")
    scored.sort(key=lambda item: (item[0], item[1]))
    probed: list[tuple[float, int, list[GroupState]]] = []
    # Bisection on the target of the on-demand packing, whose multisets then get the LPT.
    lo, hi = makespan_hint_s, scored[0][0]
    seen = {tuple(ms) for ms in multisets}
    for _ in range(num_target_probes + 2):
        mid = 0.5 * (lo + hi)
        ms_new = packed_multiset(table, order, target_s=mid, runs=bucketed)
        if ms_new is None:
            lo = mid
            continue
        hi = mid
        if tuple(ms_new) in seen:
            continue
        seen.add(tuple(ms_new))
        for target in (mid, None):
            trial = lpt(table, ms_new, order, target_s=target, runs=bucketed)
            if trial is not None:
                probed.append((max(g.load_s for g in trial), -1 - len(probed), trial))
    scored = sorted(scored + probed, key=lambda item: (item[0], item[1]))
    probed = []
    # Bisection on the target makespan for the best multisets: the smallest target every sample
    # can meet (strict LPT), between the bound and the best makespan found.
    for rank, (makespan, _, groups) in enumerate(scored[:max(1, num_refined)]):
        ms = sorted((g.size for g in groups), reverse=True)
        lo, hi = makespan_hint_s, makespan
        for probe in range(num_target_probes):
            mid = 0.5 * (lo + hi)
            trial = lpt(table, ms, order, target_s=mid, strict=True, runs=bucketed)
            if trial is None:
                lo = mid
                continue
            hi = max(g.load_s for g in trial)
            probed.append((hi, len(runs) + rank * num_target_probes + probe, trial))
    scored = sorted(scored + probed, key=lambda item: (item[0], item[1]))
    best_groups: list[GroupState] | None = None
    best_time = np.inf
    # Far from the bound, the moves that lower GPU-seconds (ejections) and change the group
    # sizes (resize moves) run too: where the gap is small they rarely pay for their time.
    far = makespan_hint_s * (1 + deep_min_gap)
    # Groups hold more samples in larger batches: the deep phase gets proportionally more moves.
    deep_moves = max_moves * max(1, len(table.samples) // 256)
    for _, _, groups in scored[:max(1, num_refined)]:
        local_search(table, groups, max_moves=max_moves)
        for g in groups:
            repack(table, g)
        if max_ejections > 0 and max(g.load_s for g in groups) > far:
            local_search(table, groups, max_moves=deep_moves, max_ejections=max_ejections)
            for g in groups:
                repack(table, g)
        makespan = max(g.load_s for g in groups)
        if makespan < best_time - 1e-12:
            best_time, best_groups = makespan, groups
    assert best_groups is not None
    if max_resizes > 0 and best_time > far:
        best_groups = resize_search(table, best_groups, max_tries=max_resizes,
                                    max_moves=deep_moves, max_ejections=max_ejections)
        best_time = max(g.load_s for g in best_groups)
    logger.debug("heuristic: %d multisets, %d runs, best compute makespan %.6f s",
                 len(multisets), len(scored), best_time)
    return to_draft(table, best_groups), multisets
