"""The partition LP bound: an LP relaxation over (sample class, group size, micro-batches).

Notation as in ``planner.bounds``: ``t_c(d)`` is a class-``c`` sample's time on a group of size
``d`` under its cheapest fitting policy, ``o`` the least fixed time of a micro-batch on a
size-``d`` group over the node spans it can have (``o_d``; every ``o`` below is that of the
row's size), ``n_c`` the class's sample count, ``N`` the world size, ``B`` the planner's
activation limit per rank (the cap less the safety margin: every plan the planner and its
baselines make keeps each micro-batch's activation bytes under it), and ``t_ck``, ``a_ck`` a
class-``c`` sample's time and activation bytes under policy ``k`` (bytes are additive over a
micro-batch's samples).

Take any plan whose compute makespan (slowest group, gradient sync excluded) is at most ``T``.
Sort its groups by size ``d`` and micro-batch count ``m`` into buckets ``(d, m)`` for
``m = 1 .. M - 1`` and one bucket ``(d, >= M)``; let ``x[c, d, m]`` be how many class-``c``
samples run on the bucket's groups and ``y[d, m]`` how many groups it has. A group of the bucket
runs its samples at some policies ``k`` in ``m`` micro-batches, so its time is at least
``sum (t_ck) + m * o <= T`` and its bytes ``sum a_ck <= m * B``. Then

1. ``sum_(d, m) x[c, d, m] = n_c`` (every sample runs once), and ``x[c, d, m] = 0`` when
   ``t_c(d) + m * o > T`` (``M`` for the last bucket);
2. ``sum d * y[d, m] <= N`` (the groups partition the world; a group with no work is left out);
3. for every price ``mu >= 0`` of a byte: adding ``mu * (sum a_ck - m * B) <= 0`` to the time,
   ``sum_c u_c(d, mu) * x[c, d, m] <= (T - m * o + mu * m * B) * y[d, m]`` with
   ``u_c(d, mu) = min_k (t_ck + mu * a_ck)`` over the policies that fit a rank alone. For the
   last bucket (``m >= M`` unknown) only ``mu <= o / B``, where ``-m * (o - mu * B)`` is at most
   its value at ``m = M``. The prices: 0 (the cheapest policies and ``m`` overheads), ``o / B``
   (a micro-batch's overhead per byte it holds: the constraint "a group needing ``A`` bytes
   runs ``A / B`` micro-batches" of the previous LP, for all ``m`` at once), and quantiles of
   the classes' recompute seconds per byte a recomputed layer saves (where a group at ``m``
   micro-batches must recompute to fit, each byte it sheds costs about that);
4. ``sum_c min_k a_ck * x[c, d, m] <= m * B * y[d, m]`` (``m < M``: bytes alone);
5. for ``k = 1, 2, 3``: ``sum over c with t_c(d) > (T - m o)/(k + 1) of x[c, d, m] <= k * y[d, m]``
   (``k + 1`` such samples in one group would exceed ``T - m o``).

So the plan gives a feasible point of this LP (integral, hence fractional too; requiring
whole ``y[d, m]`` keeps it a relaxation and tightens it): if the LP has no solution at ``T``,
no plan has compute makespan ``<= T``. Every constraint loosens as ``T`` grows (more sizes
allowed, more capacity, fewer "large" samples), so feasibility is monotone and a bisection
between a known bound and a plan's makespan finds the threshold; the largest ``T`` proven
infeasible is a lower bound. What it adds to the area bounds: several samples that each need a
mid-size group occupy one group each and the rest of those groups fill at that size's (poorer)
efficiency (5); a group whose samples need more than ``B`` bytes pays a whole second
micro-batch or the recompute that sheds the excess, not a fraction of a micro-batch (the
buckets with 3 and 4: on short video samples, whose groups hold 1.2-1.4 ``B`` at no
recompute, this is what binds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_matrix

from costmodel.evaluate import GroupLayout
from planner.bounds.bisect import feasible_bracket, threshold
from planner.costs import CostTable, ring_bound_weights

logger = logging.getLogger(__name__)

_MAX_SHARED = 3
"""Constraint 5 for ``k = 1 .. _MAX_SHARED``."""

MICRO_BATCH_BUCKETS = 3
"""``M`` by default: groups at 1, 2 and at least 3 micro-batches. On 8 steps each of
video-short 32 x 256, video-balanced 32 x 64 and 64 x 256 (the whole-group MIP, 6 bisection
steps) ``M = 4`` raised the bound by at most 0.03% at twice the time, and ``M = 2`` gave up
0.3% on video-balanced 32 x 64 for half of it; ``M = 1`` is the LP without buckets."""

_RECOMPUTE_PRICE_QUANTILES = (10.0, 50.0, 90.0)
"""Quantiles of the recompute seconds per byte saved over the classes, as byte prices (3)."""

NODE_LIMIT = 2000
"""Branch-and-bound nodes per feasibility test of the whole-group MIP: a deterministic work
limit (a test that hits it counts as feasible, so the bound only stays lower)."""

ITERATION_LIMIT = 100_000
"""Simplex iterations per feasibility test of the plain LP (HiGHS's ``maxiter``): its work limit.
Neither solve has a wall-clock limit: the bound is part of a plan's digest, and a limit in seconds
would let a loaded machine (a test that hits it counts as feasible) report a lower bound than a
quiet one for the same batch."""


def _ring_layouts(table: CostTable, d: int) -> list[GroupLayout]:
    """The ring layouts (``r > 1``) size ``d`` may run in the table (``CostTable.ring_options``), each
    at an aligned placement (what the table prices them at: the fewest nodes a group can span)."""
    cm = table.cost_model
    return [cm.place(first_rank=0, group_size=d, ring_degree=r) for r in table.ring_options.get(d, (1,)) if r > 1]


def overhead_by_size_s(table: CostTable) -> np.ndarray:
    """``o_d``: the least fixed seconds of a micro-batch on a group of each size, over the node
    spans a contiguous group of that size can have (aligned, or one node more) and, where the size
    may run a ring, over its layouts too (a group runs one of them)."""
    cm = table.cost_model
    gpn, nodes = cm.cluster.gpus_per_node, cm.cluster.num_nodes
    out = []
    for d in table.sizes:
        least = -(-d // gpn)
        spans = [n for n in (least, least + 1) if n <= max(nodes, least)]
        fixed = [cm.microbatch_fixed_s(group_size=d, num_nodes=n) for n in spans] if 1 in table.ring_options.get(
            d, (1,)) else []
        fixed += [cm.microbatch_fixed_s(group_size=d, layout=layout) for layout in _ring_layouts(table, d)]
        out.append(min(fixed))
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class LPInputs:
    """What the LP reads besides the table's times, computed once per table."""

    overhead_s: np.ndarray
    """``o_d`` per size (:func:`overhead_by_size_s`)."""
    prices_per_byte: tuple[np.ndarray, ...]
    """Per size, the byte prices ``mu > 0`` of constraint 3 (ascending; empty: memory left out)."""
    priced_s: tuple[np.ndarray, ...]
    """Per size, ``u_c(d, mu)`` as a (price, class) array (:func:`priced_times_s`)."""
    least_bytes: np.ndarray
    """``min_k a_ck`` per class and size over the policies that fit (``inf``: none fits)."""
    budget_bytes: float
    """``B``; not positive: the memory constraints are left out."""
    counts: np.ndarray | None = None
    """``n_c`` per class in the units ``x`` counts (``planner.bounds.lp_merge``: work units of a
    merged bucket); None: the class's samples."""
    samples_per_unit: np.ndarray | None = None
    """Per class, the fewest samples one unit of ``x`` holds: constraint 5 counts
    ``samples_per_unit[c] * x[c, d, m]`` samples; None: 1 (a unit is one sample)."""

    @classmethod
    def of(cls, table: CostTable) -> LPInputs:
        """The inputs of ``table``."""
        overhead = overhead_by_size_s(table)
        budget = float(table.budget_bytes)
        num_c, num_d = table.time_s.shape
        if budget <= 0 or num_c == 0:
            return cls.without_memory(table, overhead_s=overhead)
        prices, priced, least = [], [], np.full((num_c, num_d), np.inf)
        for j in range(num_d):
            saved = table.saved_bytes_per_layer[:, j]
            with np.errstate(divide="ignore", invalid="ignore"):
                rho = table.recompute_s_per_layer[:, j] / saved
            rho = rho[np.isfinite(rho) & (saved > 0) & (rho > 0)]
            mus = {overhead[j] / budget}
            if len(rho):
                mus.update(float(q) for q in np.percentile(rho, _RECOMPUTE_PRICE_QUANTILES))
            mu = np.asarray(sorted(mus), dtype=np.float64)
            u, least[:, j] = priced_times_s(table, j, mu, budget_bytes=budget)
            prices.append(mu)
            priced.append(u)
        return cls(overhead_s=overhead, prices_per_byte=tuple(prices), priced_s=tuple(priced),
                   least_bytes=least, budget_bytes=budget)

    @classmethod
    def without_memory(cls, table: CostTable, *, overhead_s: np.ndarray | None = None) -> LPInputs:
        """Inputs with no byte prices and no bytes rows (constraints 1, 2, 3 at ``mu = 0``, 5)."""
        overhead = overhead_by_size_s(table) if overhead_s is None else overhead_s
        num_c, num_d = table.time_s.shape
        empty = np.zeros(0)
        return cls(overhead_s=overhead, prices_per_byte=(empty,) * num_d,
                   priced_s=(np.zeros((0, num_c)),) * num_d,
                   least_bytes=np.full((num_c, num_d), np.inf), budget_bytes=0.0)


def priced_times_s(table: CostTable, j: int, prices_per_byte: np.ndarray, *,
                   budget_bytes: float) -> tuple[np.ndarray, np.ndarray]:
    """``u_c(d, mu) = min_k (t_ck(d) + mu * a_ck(d))`` for each price (rows) and class (columns)
    on size column ``j``, over the policies ``k`` under which the sample fits ``budget_bytes``
    alone (``inf`` where none fits); and ``min_k a_ck(d)`` per class over the same policies.

    Where the size may run rings, both are the least over its layouts (a group runs one), a ring's
    time with only its additive parts (merges, the last hop's bytes: ``CostTable.for_bounds``' rule;
    what a ring hides or exposes depends on the whole micro-batch) and its bytes with its key/value
    buffers; a ring of ``r`` holds no sample of fewer than ``2 r`` tokens."""
    cm, classes, d = table.cost_model, table.classes, table.sizes[j]
    layers = cm.num_layers
    policies = np.arange(layers + 1)[None, :]
    tokens = np.asarray(classes.tokens, dtype=np.float64)[:, None]
    frames = np.asarray(classes.frames, dtype=np.float64)[:, None]
    spatial = np.asarray(classes.spatial, dtype=np.float64)[:, None]
    layouts: list[GroupLayout | None] = [None] if 1 in table.ring_options.get(d, (1,)) else []
    layouts += _ring_layouts(table, d)
    priced = np.full((len(prices_per_byte), len(tokens)), np.inf)
    least = np.full(len(tokens), np.inf)
    for layout in layouts:
        time_s = np.asarray(cm.sample_time_s(tokens, group_size=d, recompute_layers=policies, frames=frames,
                                             spatial=spatial, layout=layout), dtype=np.float64)
        bytes_ = np.asarray(cm.activation_bytes(tokens, group_size=d, recompute_layers=policies, layout=layout),
                            dtype=np.float64)
        fits = bytes_ <= budget_bytes
        if layout is not None:
            fwd, bwd = cm.ring_alone_exposed_s(tokens[:, 0], layout=layout, additive_only=True,
                                               weights=ring_bound_weights(classes.tokens,
                                                                          np.array([len(m) for m in classes.members])))
            time_s = time_s + (layers * (fwd + bwd))[:, None] + policies * fwd[:, None]
            fits &= tokens >= 2 * layout.ring_degree
        at = np.where(fits[None], time_s[None] + prices_per_byte[:, None, None] * bytes_[None], np.inf)
        priced = np.minimum(priced, at.min(axis=2))
        least = np.minimum(least, np.where(fits, bytes_, np.inf).min(axis=1))
    return priced, least


def lp_feasible(table: CostTable, deadline_s: float, *, integral_groups: bool = False,
                inputs: LPInputs | None = None, node_limit: int = NODE_LIMIT,
                iteration_limit: int = ITERATION_LIMIT, micro_batch_buckets: int = MICRO_BATCH_BUCKETS) -> bool:
    """Whether the partition LP has a solution at compute makespan ``deadline_s``.

    ``integral_groups`` requires whole group counts ``y[d, m]`` (a small MIP, still a relaxation
    of every plan, whose group counts are whole; at most ``node_limit`` branch-and-bound nodes;
    the plain LP at most ``iteration_limit`` simplex iterations: work limits, never seconds).
    ``inputs``: :class:`LPInputs` of the table (computed when not given). ``micro_batch_buckets``:
    ``M`` (at least 1). Returns True when the solver cannot decide (a work limit,
    numerical trouble), so a caller never raises a bound on a failure.
    """
    if micro_batch_buckets < 1:
        raise ValueError(f"micro_batch_buckets must be at least 1, got {micro_batch_buckets}")
    inputs = LPInputs.of(table) if inputs is None else inputs
    o = inputs.overhead_s  # per size
    num_b = micro_batch_buckets
    time_s = table.time_s
    num_c, num_d = time_s.shape
    buckets = np.arange(1, num_b + 1, dtype=np.float64)
    cap = deadline_s - buckets[None, :] * o[:, None]  # (size, bucket): T - m o
    if not np.any(cap > 0):
        return False
    allowed = np.isfinite(time_s)[:, :, None] & (time_s[:, :, None] <= cap[None])
    if not allowed.any(axis=(1, 2)).all():
        return False
    cs, js, ms = np.nonzero(allowed)
    num_x = len(cs)
    num_y = num_d * num_b
    x_ids = np.arange(num_x)
    a_eq = coo_matrix((np.ones(num_x), (cs, x_ids)), shape=(num_c, num_x + num_y)).tocsr()
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    t_x = time_s[cs, js]
    budget = inputs.budget_bytes
    last = num_b - 1

    def bucket_row(sel: np.ndarray, x_coef: np.ndarray, y_coef: float, j: int, b: int) -> None:
        """``sum over the selected x of x_coef * x + y_coef * y[j, b] <= 0``."""
        rows.append(np.full(int(sel.sum()) + 1, len(rows)))
        cols.append(np.append(x_ids[sel], num_x + j * num_b + b))
        vals.append(np.append(x_coef, y_coef))

    for j in range(num_d):
        for b in range(num_b):
            sel = (js == j) & (ms == b)
            if not sel.any():
                continue
            m, c_sel = float(b + 1), cs[sel]
            bucket_row(sel, t_x[sel], -cap[j, b], j, b)  # 3 at mu = 0
            for mu, u in zip(inputs.prices_per_byte[j], inputs.priced_s[j], strict=True):
                if b == last and mu > o[j] / budget * (1 + 1e-12):
                    continue
                # (a class the table allows where no policy fits alone keeps its time: weaker)
                coef = np.where(np.isfinite(u[c_sel]), u[c_sel], t_x[sel])
                bucket_row(sel, coef, -(cap[j, b] + mu * m * budget), j, b)
            if b < last and budget > 0:
                least = inputs.least_bytes[c_sel, j]
                bucket_row(sel, np.where(np.isfinite(least), least, 0.0), -m * budget, j, b)
            for k in range(1, _MAX_SHARED + 1):
                big = sel & (t_x > cap[j, b] / (k + 1))
                if big.any():
                    weight = (np.ones(int(big.sum())) if inputs.samples_per_unit is None
                              else inputs.samples_per_unit[cs[big]])
                    bucket_row(big, weight, -float(k), j, b)
    num_ub = len(rows)
    # The groups partition the world.
    rows.append(np.full(num_y, num_ub))
    cols.append(num_x + np.arange(num_y))
    vals.append(np.repeat(np.asarray(table.sizes, dtype=np.float64), num_b))
    b_ub = np.zeros(num_ub + 1)
    b_ub[-1] = float(table.cost_model.cluster.num_gpus)
    a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(num_ub + 1, num_x + num_y)).tocsr()
    counts = (np.array([len(m) for m in table.classes.members], dtype=np.float64) if inputs.counts is None
              else inputs.counts)
    if integral_groups:
        # (presolve off: 1.2-2.5x slower with it on the MIP)
        result = milp(np.zeros(num_x + num_y), integrality=np.concatenate((np.zeros(num_x), np.ones(num_y))),
                      bounds=Bounds(0, np.inf),
                      constraints=[LinearConstraint(a_ub, -np.inf, b_ub), LinearConstraint(a_eq, counts, counts)],
                      options={"node_limit": node_limit, "presolve": False})
    else:
        result = linprog(np.zeros(num_x + num_y), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=counts, bounds=(0, None),
                         method="highs", options={"maxiter": iteration_limit, "presolve": True})
    return bool(result.status != 2)  # 2: proven infeasible


def partition_lp_bound(table: CostTable, *, lower_s: float, iterations: int, integral_groups: bool = False,
                       node_limit: int = NODE_LIMIT, micro_batch_buckets: int = MICRO_BATCH_BUCKETS,
                       max_classes: int | None = None, rel_tol: float = 0.0) -> float:
    """The partition LP bound on the compute makespan, at least ``lower_s``.

    First a bracket from the problem alone (:func:`feasible_bracket`: probes at ``lower_s``
    times 1.01, 1.02, 1.04, ... until the plain LP with one micro-batch bucket is feasible), then
    a bisection in it; with ``integral_groups`` or ``micro_batch_buckets > 1``, the same on that
    finer problem from where the coarse LP turned feasible. The finer problem is infeasible
    wherever the coarse LP is (merging a solution's buckets of each size gives a solution of the
    coarse LP, and a MIP solution is an LP solution), so its threshold is at or above the coarse
    one. No plan's time enters: a bound above a plan's step time is a bug the caller sees
    (``planner.planning.check_bound``).

    Args:
        table: Costs of the batch.
        lower_s: A known lower bound of the compute makespan (returned when the LP cannot
            raise it).
        iterations: Bisection steps of each phase once the bracket is found.
        integral_groups: Whole group counts (``lp_feasible``): tighter, several times the time.
        node_limit: Branch-and-bound nodes per MIP test (``lp_feasible``).
        micro_batch_buckets: ``M`` of the finer problem (``lp_feasible``; more is tighter
            and slower).
        max_classes: Merge the classes into at most this many buckets first
            (``planner.bounds.lp_merge``: still a relaxation, cheaper, looser); None: never.
        rel_tol: Each bisection stops early once its bracket is within this fraction of its top
            (``planner.bounds.bisect.threshold``): fewer solves, a bound up to that much lower.

    Returns:
        The largest deadline the LP (or MIP) was proven infeasible at (less a 1e-9 relative
        margin), or ``lower_s``; the last deadline probed (about 40 times ``lower_s``) when none
        up to there was feasible.
    """
    if iterations <= 0 or not lower_s > 0:
        return lower_s
    inputs = LPInputs.of(table)
    if max_classes is not None:
        from planner.bounds.lp_merge import merged_problem

        table, inputs = merged_problem(table, inputs, max_classes)

    def coarse(deadline_s: float) -> bool:
        return lp_feasible(table, deadline_s, inputs=inputs, micro_batch_buckets=1)

    def fine(deadline_s: float) -> bool:
        return lp_feasible(table, deadline_s, integral_groups=integral_groups, inputs=inputs,
                           node_limit=node_limit, micro_batch_buckets=micro_batch_buckets)

    probe = lower_s * (1 + 1e-3)
    if coarse(probe):
        lo, hi = lower_s, probe
    else:
        lo, hi = feasible_bracket(coarse, probe)
        if hi == float("inf"):
            logger.warning("partition LP infeasible up to %.6g s (lower bound %.6g s)", lo, lower_s)
            return lo
        lo, hi = threshold(coarse, lo, hi, iterations, rel_tol=rel_tol)
    if (integral_groups or micro_batch_buckets > 1) and not fine(hi):
        lo, top = feasible_bracket(fine, hi)
        if top == float("inf"):
            logger.warning("partition MIP infeasible up to %.6g s (lower bound %.6g s)", lo, lower_s)
            return lo
        lo, _ = threshold(fine, lo, top, iterations, rel_tol=rel_tol)
    logger.debug("partition LP bound %.6f s (from %.6f s)", lo, lower_s)
    return max(lower_s, lo * (1 - 1e-9))  # margin for the solver's feasibility tolerance
