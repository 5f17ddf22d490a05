"""The partition LP bound: an LP relaxation over (sample class, group size) with group counts.

Notation as in ``planner.bounds``: ``t_c(d)`` is a class-``c`` sample's time on a group of size
``d`` under its cheapest fitting policy, ``o`` the per-micro-batch overhead (``o_d``: the least
fixed time of a micro-batch on a size-``d`` group over the node spans it can have; every ``o``
below is that of the constraint's size), ``n_c`` the
class's sample count, ``N`` the world size.

Take any plan whose compute makespan (slowest group, gradient sync excluded) is at most ``T``.
Let ``x[c, d]`` be how many class-``c`` samples it runs on groups of size ``d`` and ``y[d]``
how many groups of size ``d`` it has. Then

1. ``sum_d x[c, d] = n_c`` (every sample runs once), and ``x[c, d] = 0`` when
   ``t_c(d) + o > T`` (a group that runs it pays at least one overhead);
2. ``sum_d d * y[d] <= N`` (the groups partition the world);
3. ``sum_c t_c(d) * x[c, d] <= (T - o) * y[d]`` (each group's samples take at least their
   ``t_c(d)``, and a group with work pays ``o`` at least once);
4. for ``k = 1, 2, 3``: ``sum over c with t_c(d) > (T - o)/(k + 1) of x[c, d] <= k * y[d]``
   (``k + 1`` such samples in one group would exceed ``T - o``);
5. ``sum_c u_c(d) * x[c, d] <= T * y[d]`` with ``u_c(d) = min_k (t_ck(d) + o * a_ck(d) / B)``
   over the policies ``k`` that fit: ``B`` is a rank's activation budget and ``t_ck``, ``a_ck``
   a class-``c`` sample's time and activation bytes under policy ``k``. A micro-batch holds at
   most ``B`` bytes, so a group whose samples need ``A`` bytes runs at least ``A / B``
   micro-batches and pays ``o`` for each: its time is at least ``sum (t_ck + o * a_ck / B)``
   over its samples at their policies. (3 charges one ``o`` per group and each sample its
   fastest fitting policy; where memory makes a group choose between more micro-batches and
   more recompute, as on short video samples, this one binds.)

So the plan gives a feasible point of this LP (integral, hence fractional too; requiring
whole ``y[d]`` keeps it a relaxation and tightens it): if the LP has
no solution at ``T``, no plan has compute makespan ``<= T``. Every constraint loosens as ``T``
grows (more sizes allowed, more capacity, fewer "large" samples), so feasibility is monotone
and a bisection between a known bound and a plan's makespan finds the threshold; the largest
``T`` proven infeasible is a lower bound. Constraint 4 is what the area bounds miss: several
samples that each need a mid-size group occupy one group each, and the rest of those groups
can only be filled at that size's (poorer) efficiency.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from planner.costs import CostTable

logger = logging.getLogger(__name__)

_MAX_SHARED = 3
"""Constraint 4 for ``k = 1 .. _MAX_SHARED``."""


def overhead_by_size_s(table: CostTable) -> np.ndarray:
    """``o_d``: the least fixed seconds of a micro-batch on a group of each size, over the node
    spans a contiguous group of that size can have (aligned, or one node more)."""
    cm = table.cost_model
    gpn, nodes = cm.cluster.gpus_per_node, cm.cluster.num_nodes
    out = []
    for d in table.sizes:
        least = -(-d // gpn)
        spans = [n for n in (least, least + 1) if n <= max(nodes, least)]
        out.append(min(cm.microbatch_fixed_s(group_size=d, num_nodes=n) for n in spans))
    return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class LPInputs:
    """What the LP reads besides the table's times, computed once per table."""

    overhead_s: np.ndarray
    """``o_d`` per size (:func:`overhead_by_size_s`)."""
    with_mb_s: np.ndarray
    """``u_c(d)`` per class and size (:func:`with_micro_batches_s`; zeros: no constraint 5)."""

    @classmethod
    def of(cls, table: CostTable) -> LPInputs:
        """The inputs of ``table``."""
        overhead = overhead_by_size_s(table)
        return cls(overhead_s=overhead, with_mb_s=with_micro_batches_s(table, overhead_s=overhead))


def with_micro_batches_s(table: CostTable, *, overhead_s: np.ndarray) -> np.ndarray:
    """``u_c(d) = min_k (t_ck(d) + o_d * a_ck(d) / B)`` per class and size (constraint 5) over
    the policies ``k`` under which the sample fits a rank alone; ``inf`` where none fits, and
    zeros when the budget is not positive (no constraint). ``overhead_s``: ``o_d`` per size
    (:func:`overhead_by_size_s`)."""
    cm = table.cost_model
    budget = cm.activation_budget_bytes()
    num_c, num_d = table.time_s.shape
    if budget <= 0 or num_c == 0:
        return np.zeros((num_c, num_d))
    policies = np.arange(cm.num_layers + 1)[None, :]
    classes = table.classes
    tokens = np.asarray(classes.tokens, dtype=np.float64)[:, None]
    frames = np.asarray(classes.frames, dtype=np.float64)[:, None]
    spatial = np.asarray(classes.spatial, dtype=np.float64)[:, None]
    out = np.full((num_c, num_d), np.inf)
    for j, d in enumerate(table.sizes):
        time_s = np.asarray(cm.sample_time_s(tokens, group_size=d, recompute_layers=policies, frames=frames,
                                             spatial=spatial), dtype=np.float64)
        bytes_ = np.asarray(cm.activation_bytes(tokens, group_size=d, recompute_layers=policies),
                            dtype=np.float64)
        cost = np.where(bytes_ <= budget, time_s + overhead_s[j] * bytes_ / budget, np.inf)
        out[:, j] = cost.min(axis=1)
    return out


def lp_feasible(table: CostTable, deadline_s: float, *, integral_groups: bool = False,
                inputs: LPInputs | None = None) -> bool:
    """Whether the partition LP has a solution at compute makespan ``deadline_s``.

    ``integral_groups`` requires whole group counts ``y[d]`` (a small MIP, still a relaxation
    of every plan, whose group counts are whole). ``inputs``: :class:`LPInputs` of the table
    (computed when not given). Returns True when the solver cannot decide (time limit,
    numerical trouble), so a caller never raises a bound on a failure.
    """
    inputs = LPInputs.of(table) if inputs is None else inputs
    with_mb = inputs.with_mb_s
    o = inputs.overhead_s  # per size
    cap = deadline_s - o
    if not np.any(cap > 0):
        return False
    time_s = table.time_s
    num_c, num_d = time_s.shape
    counts = np.array([len(m) for m in table.classes.members], dtype=np.float64)
    allowed = np.isfinite(time_s) & (time_s + o[None, :] <= deadline_s)
    if not allowed.any(axis=1).all():
        return False
    cs, js = np.nonzero(allowed)
    num_x = len(cs)
    num_vars = num_x + num_d
    x_ids = np.arange(num_x)
    # Equalities: every class runs exactly n_c times.
    a_eq = coo_matrix((np.ones(num_x), (cs, x_ids)), shape=(num_c, num_vars)).tocsr()
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    b_ub: list[float] = []

    def per_size_row(sel: np.ndarray, x_coef: np.ndarray, y_coef: float, j: int) -> None:
        """``sum over the selected x of x_coef * x + y_coef * y[j] <= 0``."""
        rows.append(np.full(int(sel.sum()) + 1, len(b_ub)))
        cols.append(np.append(x_ids[sel], num_x + j))
        vals.append(np.append(x_coef, y_coef))
        b_ub.append(0.0)

    t_x = time_s[cs, js]
    # Capacity per size: sum_c t_c(d) x[c, d] - cap * y[d] <= 0.
    for j in range(num_d):
        sel = js == j
        per_size_row(sel, t_x[sel], -cap[j], j)
    # Micro-batches that memory forces: sum_c u_c(d) x[c, d] - T y[d] <= 0.
    if with_mb.any():
        # (a class the table allows where no policy fits the budget alone keeps its time:
        # weaker, never wrong)
        u = np.where(np.isfinite(with_mb[cs, js]), with_mb[cs, js], t_x)
        for j in range(num_d):
            sel = js == j
            per_size_row(sel, u[sel], -deadline_s, j)
    # At most k samples longer than cap / (k + 1) per group.
    for k in range(1, _MAX_SHARED + 1):
        for j in range(num_d):
            sel = (js == j) & (t_x > cap[j] / (k + 1))
            if sel.any():
                per_size_row(sel, np.ones(int(sel.sum())), -float(k), j)
    # The groups partition the world.
    rows.append(np.full(num_d, len(b_ub)))
    cols.append(num_x + np.arange(num_d))
    vals.append(np.asarray(table.sizes, dtype=np.float64))
    b_ub.append(float(table.cost_model.cluster.num_gpus))
    a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(len(b_ub), num_vars)).tocsr()
    integrality = np.concatenate((np.zeros(num_x), np.ones(num_d))) if integral_groups else None
    result = linprog(np.zeros(num_vars), A_ub=a_ub, b_ub=np.asarray(b_ub), A_eq=a_eq,
                     b_eq=counts, bounds=(0, None), method="highs", integrality=integrality,
                     options={"time_limit": 2.0})
    return bool(result.status != 2)  # 2: proven infeasible


def partition_lp_bound(table: CostTable, *, lower_s: float, upper_s: float,
                       iterations: int, integral_groups: bool = False) -> float:
    """The partition LP bound on the compute makespan, at least ``lower_s``.

    Args:
        table: Costs of the batch.
        lower_s: A known lower bound of the compute makespan (returned when the LP cannot
            raise it).
        upper_s: A compute makespan some plan reaches (the LP is feasible there).
        iterations: Bisection steps after the first test just above ``lower_s``.
        integral_groups: Whole group counts (``lp_feasible``): tighter, about twice the time.

    Returns:
        The largest deadline in ``[lower_s, upper_s)`` where the LP was proven infeasible
        (less a 1e-9 relative margin), or ``lower_s``.
    """
    if not upper_s > lower_s or iterations <= 0:
        return lower_s
    lo, hi = lower_s, upper_s
    probe = lower_s * (1 + 1e-3)
    inputs = LPInputs.of(table)
    if probe >= hi or lp_feasible(table, probe, integral_groups=integral_groups, inputs=inputs):
        return lo
    lo = probe
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if lp_feasible(table, mid, integral_groups=integral_groups, inputs=inputs):
            hi = mid
        else:
            lo = mid
    logger.debug("partition LP bound %.6f s (from %.6f s; plan %.6f s)", lo, lower_s, upper_s)
    return max(lower_s, lo * (1 - 1e-9))  # margin for the solver's feasibility tolerance
