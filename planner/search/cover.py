"""A plan from whole groups: the pattern cover of a small batch, made integral.

The pattern bound (``planner.bounds.patterns``) asks whether the batch can be covered by groups
of maximal patterns (a size and the samples it runs by a deadline) on the world's ranks. On the
table's own times (each size's layout, a ring charged as each sample would have it alone: an
upper bound of a call's share) a cover in whole groups is a plan: the groups are placed, each
packed and polished by the local search (``planner.search.polish``) and priced exactly by the
caller. The least deadline with such a cover is found from the fractional threshold up (a
bisection on the LP, then, at a few deadlines above it, whole numbers of the patterns a least-rank
fractional cover uses), so where the heuristic packs long
samples poorly (a few long clips, each needing a group of its own, and the short ones spread
unevenly) this finds the packing the bound saw.
"""

from __future__ import annotations

import logging

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from planner.assemble import Draft
from planner.baselines.common import place_layout
from planner.bounds.lp import overhead_by_size_s
from planner.bounds.patterns import ITERATION_LIMIT, PatternMemo, cover_patterns, pattern_bound
from planner.costs import CostTable
from planner.search.polish import polish

logger = logging.getLogger(__name__)

DEADLINE_STEPS = (0.0, 0.005, 0.01, 0.02, 0.04)
"""Relative steps above the fractional threshold at which a whole cover is tried, in order."""

NODE_LIMIT = 200
"""Branch-and-bound nodes per integer cover (over the patterns a least-rank fractional cover
uses, at most the classes + 1): a work limit (no cover found counts as none)."""


def integral_cover(table: CostTable, deadline_s: float, *, overhead_s: np.ndarray, max_visits: int,
                   memo: PatternMemo | None = None) -> list[tuple[int, list[int]]] | None:
    """Groups ``(size, samples per class)`` covering every sample by ``deadline_s`` on at most
    the world's ranks, fewest ranks first; None when none is found within the work limits."""
    found = cover_patterns(table, deadline_s, overhead_s=overhead_s, max_visits=max_visits, memo=memo)
    if found is None or found[0].shape[1] == 0:
        return None
    a, sizes = found
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    if (a.max(axis=1) == 0).any():
        return None
    n = float(table.cost_model.cluster.num_gpus)
    d = sizes.astype(np.float64)
    # the least-rank fractional cover (a vertex: at most classes + 1 patterns in use), then
    # whole groups of those patterns only: a small integer program whatever the pattern count
    lp = linprog(d, A_ub=np.vstack([-a, d[None, :]]), b_ub=np.concatenate([-counts, [n]]), bounds=(0, None),
                 method="highs", options={"maxiter": ITERATION_LIMIT})
    if lp.status != 0:
        return None
    used = np.flatnonzero(lp.x > 1e-9)
    a, sizes, d = a[:, used], sizes[used], d[used]
    result = milp(d, integrality=np.ones(len(d)), bounds=Bounds(0, np.floor(n / d)),
                  constraints=[LinearConstraint(a.astype(np.float64), counts, np.inf),
                               LinearConstraint(d[None, :], -np.inf, n)],
                  options={"node_limit": NODE_LIMIT, "presolve": True})
    if result.x is None:
        return None
    z = np.rint(result.x).astype(np.int64)
    return [(int(sizes[p]), [int(v) for v in a[:, p]]) for p in np.flatnonzero(z) for _ in range(z[p])]


def cover_draft(table: CostTable, *, lower_s: float, iterations: int, max_visits: int, max_moves: int,
                intra: bool, memo: PatternMemo | None = None, skip_within_s: float | None = None) -> Draft | None:
    """A plan of the batch from a whole cover at the least deadline found (None: none found).

    ``lower_s``: a lower bound of the compute makespan to start from (the pattern bound on the
    table's own times is bisected from it). Surplus samples of a cover (it may hold more of a
    class than the batch has) are left out of the later groups; groups left empty are dropped.
    ``memo``: the table's enumerations, shared with the caller's pattern bound (the threshold
    found here is left in ``memo.bound_s``). ``skip_within_s``: no whole cover is tried when the
    pattern threshold reaches this compute makespan (the caller's plan is then within its
    tolerance of what a cover could give).
    """
    overhead = overhead_by_size_s(table)
    start_s = pattern_bound(table, lower_s=lower_s, iterations=iterations, max_visits=max_visits, memo=memo)
    if skip_within_s is not None and start_s >= skip_within_s:
        logger.debug("cover search: the plan is within tolerance of the pattern threshold %.6g s", start_s)
        return None
    for step in DEADLINE_STEPS:
        groups = integral_cover(table, start_s * (1 + step), overhead_s=overhead, max_visits=max_visits, memo=memo)
        if groups is not None:
            break
    else:
        logger.debug("cover search: no whole cover up to %.6g s", start_s * (1 + DEADLINE_STEPS[-1]))
        return None
    pools = [list(m) for m in table.classes.members]
    members: list[tuple[int, list[int]]] = []
    for size, per_class in sorted(groups, key=lambda g: -g[0]):
        taken = [pools[c].pop(0) for c, k in enumerate(per_class) for _ in range(min(k, len(pools[c])))]
        if taken:
            members.append((size, taken))
    placed = place_layout([size for size, _ in members], table)
    if placed is None:
        return None
    for group, (_, taken) in zip(placed, members, strict=False):
        group.micro_batches = [[(i, 0)] for i in sorted(taken)]
    return polish(table, placed, max_moves=max_moves, intra=intra)
