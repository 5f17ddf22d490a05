"""The pattern bound: a configuration LP over the groups a plan can have.

Notation as in ``planner.bounds``: ``t_c(d)`` is a class-``c`` sample's time on a group of size
``d`` in the lower bounds' view of the table (``CostTable.for_bounds``: its cheapest fitting
policy alone, a ring's additive parts only), ``o_d`` the least fixed time of a micro-batch on a
size-``d`` group (``planner.bounds.lp.overhead_by_size_s``), ``n_c`` the class's sample count and
``N`` the world size.

Take any plan whose compute makespan is at most ``T``. Each of its groups has a size ``d`` and
runs a multiset ``a`` of samples (``a_c <= n_c`` of class ``c``) in at least one micro-batch, so
``sum_c a_c t_c(d) + o_d <= T``: the group fits the *pattern* ``(d, a)``. Then there are
``z_p >= 0`` groups per pattern covering every sample (``sum_p a_cp z_p >= n_c``) on at most
``N`` ranks (``sum_p d_p z_p <= N``): the plan's own groups, whole numbers, so a fractional
``z`` too. Only *maximal* patterns are needed (none can take one more sample of any class
without passing ``T`` or ``n_c``): every group lies inside one, and covering allows the
surplus. If this LP (Gilmore and Gomory's configuration LP of bin packing, 1961) has no
solution, no plan has compute makespan ``<= T``; feasibility grows with ``T``, so a bisection
finds the threshold (``planner.bounds.bisect``).

What it adds to the area bounds and the partition LP: a sample is never split between groups.
Where a few long samples each need a group of their own and the shorter ones cannot fill the
rest evenly (16 clips of 20k-148k tokens on 64 GPUs: the other bounds sat 5-12% under the
plans), the patterns see it. They multiply with the distinct lengths a group can hold together,
so the bound runs on small batches (``PlannerConfig.pattern_bound_max_samples``) and stops,
keeping what it proved, past ``MAX_VISITS`` or ``MAX_PATTERNS``. The LP is limited by simplex
iterations, never by wall time, and a test that hits the limit counts as feasible, so the bound
only stays lower.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog

from planner.bounds.bisect import feasible_bracket, threshold
from planner.bounds.lp import overhead_by_size_s
from planner.costs import CostTable

logger = logging.getLogger(__name__)

MAX_PATTERNS = 5_000
"""Maximal patterns over all sizes at one deadline, at most; past it the bound gives up."""

MAX_VISITS = 20_000
"""Search nodes of the pattern enumeration at one deadline, at most (the same give-up): about
0.1 s of Python; batches of many short distinct lengths, whose large groups hold countless
combinations, give up here."""

ITERATION_LIMIT = 20_000
"""Simplex iterations per feasibility LP (HiGHS's ``maxiter``): its work limit."""

REL_TOL = 1e-9
"""Patterns are kept up to ``T (1 + REL_TOL)`` (floating-point sums), and the bound reported is
the deadline proven infeasible less this margin."""


class _TooManyError(Exception):
    """The enumeration passed its work limit."""


@dataclass(slots=True)
class PatternMemo:
    """What the pattern enumerations of one table found, shared by every caller that reads the
    same table with the same work limit: the cover search and the pattern bound of one plan
    (``planner.planning``) enumerate at many of the same deadlines, and without a memo each
    enumeration that gives up costs its whole ``max_visits`` again.

    A memo belongs to one table object and one ``max_visits``. It only saves work and gives up
    sooner: a deadline enumerated again returns what it returned, and a deadline at or above one
    where an enumeration gave up gives up at once (a larger deadline admits more and larger
    patterns, so its search mostly grows). Giving up keeps a bound lower (what was proven stands)
    and skips a cover attempt, so every bound stays a lower bound.
    """

    found: dict[float, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Per deadline enumerated: its ``(counts, sizes)`` (``cover_patterns``)."""
    given_up_s: float = math.inf
    """The least deadline at which an enumeration gave up (inf: none)."""
    bound_s: float | None = None
    """What ``pattern_bound`` last returned on this table (None: it has not run)."""


def maximal_patterns(times_s: np.ndarray, counts: np.ndarray, capacity_s: float, *,
                     budget: list[int]) -> list[tuple[int, ...]]:
    """Every maximal multiset of classes (``a_c <= counts[c]``, at least one sample) whose summed
    ``times_s`` is at most ``capacity_s``: no class with ``a_c < counts[c]`` fits in what is left.

    Classes of infinite time never enter. ``budget``: ``[visits left]``, decremented per search
    node; the search raises ``_TooManyError`` when it runs out.
    """
    order = [int(c) for c in np.argsort(-times_s, kind="stable") if math.isfinite(times_s[c])]
    num = len(times_s)
    out: list[tuple[int, ...]] = []
    chosen = [0] * num
    limit = capacity_s * (1 + REL_TOL)
    # all the samples of the classes from position i on: what the rest of a pattern can add at most
    rest_s: list[float] = np.concatenate([np.cumsum([counts[c] * times_s[c] for c in order][::-1])[::-1],
                                          [0.0]]).tolist()
    # the search reads Python floats and ints: the same values, but numpy scalars cost several
    # times as much per access and per operation
    time_of: list[float] = np.asarray(times_s, dtype=np.float64).tolist()
    count_of: list[int] = np.asarray(counts, dtype=np.int64).tolist()

    def visit(i: int, used_s: float, short_s: float) -> None:
        """``short_s``: the least time among the classes decided below their count (inf: none);
        one of them still fits whatever the rest adds, the pattern cannot be maximal."""
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooManyError
        if short_s <= limit - used_s - rest_s[i]:
            return
        if i == len(order):
            # maximal: rest_s[i] is 0, so the test above already refused a pattern where a class
            # below its count (the least of them, short_s) still fits what is left
            if used_s > 0:
                out.append(tuple(chosen))
            return
        c = order[i]
        t_c, n_c = time_of[c], count_of[c]
        most = min(n_c, math.floor((limit - used_s) / t_c)) if t_c > 0 else n_c
        for a in range(most, -1, -1):
            chosen[c] = a
            visit(i + 1, used_s + a * t_c, short_s if a == n_c else min(short_s, t_c))
        chosen[c] = 0

    visit(0, 0.0, math.inf)
    return out


def cover_patterns(table: CostTable, deadline_s: float, *, overhead_s: np.ndarray | None = None,
                   max_visits: int = MAX_VISITS, memo: PatternMemo | None = None
                   ) -> tuple[np.ndarray, np.ndarray] | None:
    """The maximal patterns at compute makespan ``deadline_s``: ``(counts, sizes)``, a (classes x
    patterns) array of how many samples of each class a pattern holds and each pattern's group
    size (both empty when nothing fits); None when the enumeration gives up (``memo``: what earlier
    enumerations of this table found, read and updated)."""
    if memo is not None:
        if deadline_s >= memo.given_up_s:
            return None
        if deadline_s in memo.found:
            return memo.found[deadline_s]
    found = _enumerate(table, deadline_s, overhead_s=overhead_s, max_visits=max_visits)
    if memo is not None:
        if found is None:
            memo.given_up_s = min(memo.given_up_s, deadline_s)
        else:
            memo.found[deadline_s] = found
    return found


def _enumerate(table: CostTable, deadline_s: float, *, overhead_s: np.ndarray | None,
               max_visits: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``cover_patterns`` without the memo."""
    overhead = overhead_by_size_s(table) if overhead_s is None else overhead_s
    counts = np.array([len(m) for m in table.classes.members], dtype=np.int64)
    num_gpus = table.cost_model.cluster.num_gpus
    columns: list[tuple[int, ...]] = []
    sizes: list[int] = []
    budget = [max_visits]
    try:
        for j, d in enumerate(table.sizes):
            if d > num_gpus or not deadline_s > overhead[j]:
                continue
            found = maximal_patterns(np.asarray(table.time_s[:, j], dtype=np.float64), counts,
                                     deadline_s - float(overhead[j]), budget=budget)
            columns += found
            sizes += [d] * len(found)
            if len(columns) > MAX_PATTERNS:
                raise _TooManyError
    except _TooManyError:
        logger.debug("patterns: more than %d patterns or %d visits at %.6g s", MAX_PATTERNS, max_visits, deadline_s)
        return None
    a = np.array(columns, dtype=np.int64).T.reshape(len(counts), len(columns))
    return a, np.array(sizes, dtype=np.int64)


def cover_feasible(table: CostTable, deadline_s: float, *, overhead_s: np.ndarray | None = None,
                   iteration_limit: int = ITERATION_LIMIT, max_visits: int = MAX_VISITS,
                   memo: PatternMemo | None = None) -> bool | None:
    """Whether the batch's samples can be covered by groups of maximal patterns at compute
    makespan ``deadline_s`` on at most the world's ranks (``table``: the bounds' view). True also
    when the LP reaches its iteration limit; None when the enumeration gives up (too many
    patterns)."""
    found = cover_patterns(table, deadline_s, overhead_s=overhead_s, max_visits=max_visits, memo=memo)
    if found is None:
        return None
    a, sizes = found
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    if a.shape[1] == 0 or (a.max(axis=1) == 0).any():
        return False  # some class fits no group by the deadline
    d = sizes.astype(np.float64)
    # a feasibility LP (no objective): a fractional cover on at most N ranks; 2 = proven
    # infeasible, an iteration limit (1) counts as feasible
    result = linprog(np.zeros(len(d)), A_ub=np.vstack([-a, d[None, :]]),
                     b_ub=np.concatenate([-counts, [float(table.cost_model.cluster.num_gpus)]]),
                     bounds=(0, None), method="highs", options={"maxiter": iteration_limit})
    return bool(result.status != 2)


def pattern_bound(table: CostTable, *, lower_s: float, iterations: int, iteration_limit: int = ITERATION_LIMIT,
                  max_visits: int = MAX_VISITS, memo: PatternMemo | None = None) -> float:
    """The pattern bound on the compute makespan, at least ``lower_s`` (``table``: the bounds'
    view, ``CostTable.for_bounds``; ``memo``: enumerations shared with other callers on it).

    A bracket probed upward from ``lower_s`` alone, then ``iterations`` bisection steps
    (``planner.bounds.bisect``); no plan's time enters. Returns the largest deadline proven
    infeasible less a ``REL_TOL`` margin, or ``lower_s``.
    """
    if iterations <= 0 or not lower_s > 0:
        return lower_s
    overhead = overhead_by_size_s(table)
    proven = [lower_s]  # the largest deadline proven infeasible so far

    def feasible(deadline_s: float) -> bool:
        answer = cover_feasible(table, deadline_s, overhead_s=overhead, iteration_limit=iteration_limit,
                                max_visits=max_visits, memo=memo)
        if answer is None:
            raise _TooManyError
        if not answer:
            proven[0] = max(proven[0], deadline_s)
        return answer

    try:
        if feasible(lower_s * (1 + 1e-3)):
            return lower_s
        lo, hi = feasible_bracket(feasible, lower_s * (1 + 1e-3))
        if hi == float("inf"):
            logger.warning("pattern cover infeasible up to %.6g s (lower bound %.6g s)", lo, lower_s)
            return lo
        threshold(feasible, lo, hi, iterations)
    except _TooManyError:  # stop where the enumeration gave up; what was proven stands
        pass
    logger.debug("pattern bound %.6f s (from %.6f s)", proven[0], lower_s)
    bound = max(lower_s, proven[0] * (1 - REL_TOL))
    if memo is not None:
        memo.bound_s = bound
    return bound
