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

import numpy as np

from planner.assemble import Draft, DraftGroup
from planner.costs import CostTable
from planner.search.group_state import GroupState, repack
from planner.search.intra import intra_layout
from planner.search.local_search import local_search
from planner.search.lpt import lpt
from planner.search.multisets import candidate_multisets, packed_multiset
from planner.search.resize import lone_merge, resize_search

logger = logging.getLogger(__name__)


def _order(table: CostTable) -> list[int]:
    """Samples by decreasing work (most efficient GPU-seconds), ties by index."""
    sizes = np.asarray(table.sizes, dtype=np.float64)
    work = np.min(table.time_s * sizes[None, :], axis=1)
    cls = np.asarray(table.classes.class_of, dtype=np.int64)
    # lexsort: by the last key (-work), ties by the first (index): the (-work, index) order.
    return np.lexsort((np.arange(len(cls)), -work[cls])).tolist()


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


LARGE_BATCH_SAMPLES = 8192
"""Above this many samples the candidate multisets get 2 LPT runs instead of at least 4."""


def lpt_run_budget(num_lpt_runs: int, num_samples: int) -> int:
    """LPT runs on the candidate multisets for a batch of ``num_samples``.

    Work limits are sized for 256 samples; larger batches get proportionally fewer runs, never
    fewer than 4 (2 above ``LARGE_BATCH_SAMPLES``, where each run costs 0.2-0.3 s and the
    on-demand packing's multisets, which get their own runs, beat the candidates'), so a preset
    stays near its budget at any size.
    """
    floor = 4 if num_samples <= LARGE_BATCH_SAMPLES else 2
    return max(min(num_lpt_runs, floor), round(num_lpt_runs * min(1.0, 256 / max(num_samples, 1))))


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
            kmin = table.column(g.col)[6]  # a list: no numpy scalar per sample
            mbs = [[(i, int(kmin[cls[i]])) for i in sorted(mb)] for mb in g.mbs]
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
    num_lpt_runs = lpt_run_budget(num_lpt_runs, len(table.samples))
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
    seen = {tuple(ms) for ms, _ in runs[:max(1, num_lpt_runs)]}  # the multisets the LPT ran
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
            # Only the groups the deep search changed: the others are as repacked just above,
            # which repacking again leaves as they are (11,000 groups at 16,384 ranks).
            for gi in sorted(local_search(table, groups, max_moves=deep_moves, max_ejections=max_ejections)):
                repack(table, groups[gi])
        makespan = max(g.load_s for g in groups)
        if makespan < best_time - 1e-12:
            best_time, best_groups = makespan, groups
    assert best_groups is not None
    best_groups = lone_merge(table, best_groups, max_moves=deep_moves, max_ejections=max_ejections)
    best_time = max(g.load_s for g in best_groups)
    if max_resizes > 0 and best_time > far:
        best_groups = resize_search(table, best_groups, max_tries=max_resizes,
                                    max_moves=deep_moves, max_ejections=max_ejections)
        best_time = max(g.load_s for g in best_groups)
    logger.debug("heuristic: %d multisets, %d runs, best compute makespan %.6f s",
                 len(multisets), len(scored), best_time)
    return to_draft(table, best_groups), multisets
