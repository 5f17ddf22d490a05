"""CP-SAT models of the step plan (with ``lns``, the only modules that import OR-Tools).

Two models, each ``build_* / solve / decode``, both seeded with the heuristic's draft as a
complete hint and time-limited (CP-SAT's deterministic time from the config, plus the wall
clock left as a safety cap):

* **exact** (tiny batches: ``config.exact_max_samples`` samples on ``config.exact_max_ranks``
  ranks): one model per placeable multiset of group sizes; per sample, group and micro-batch
  slot a boolean, per sample its checkpoint policy ``k`` (time and memory linear in ``k``, plus
  the rematerialised layer when ``k >= 1``), exact memory per micro-batch, overhead per used
  micro-batch. Solved to optimality it proves the plan optimal under the cost model.
* **large-neighbourhood search** (everything else, ``planner.search.lns``): CP-SAT re-solves
  sub-problems of the heuristic's plan exactly (the slowest group and a few light ones: which
  samples, which micro-batch, which policy), round after round. It proves no plan bound.
  (It replaced an aggregated model over class counts per fixed group, which relaxed the
  packing and improved 2 of 100 steps at the 1 s budget.)

Costs become integers through ``TIME_UNITS_PER_S``; memory is in bytes, rounded up (and the
bytes saved per recomputed layer rounded down), so every solution CP-SAT accepts fits.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from costmodel.evaluate import nodes_spanned
from planner.assemble import Draft, DraftGroup
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.placement import place_groups
from planner.search.lns import LnsStats, lns

logger = logging.getLogger(__name__)

TIME_UNITS_PER_S = 1_000_000_000
"""Integer time unit of the models: nanoseconds."""

@dataclass(frozen=True, slots=True)
class CpsatResult:
    """What a CP-SAT phase returns.

    Attributes:
        draft: CP-SAT's best draft, or None when it found none.
        status: ``OPTIMAL`` (proven), ``FEASIBLE`` or ``UNKNOWN``.
        method: ``cpsat-exact`` or ``cpsat-lns``.
        bound_s: A proven lower bound of the compute makespan over all plans (exact model
            only), seconds, without the gradient sync.
    """

    draft: Draft | None
    status: str
    method: str
    bound_s: float | None
    lns: LnsStats | None = None
    """The rounds of the large-neighbourhood search (None for the exact model)."""


def is_exact_size(table: CostTable, config: PlannerConfig) -> bool:
    """True when the batch is small enough for the exact model, and its costs are additive over
    samples (no size may run a ring: a ring's cost per layer call is not, ``planner.costs``)."""
    return (not table.has_ring and len(table.samples) <= config.exact_max_samples
            and table.cost_model.cluster.num_gpus <= config.exact_max_ranks)


def _solver(config: PlannerConfig, *, wall_s: float, deterministic_s: float | None
            ) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = config.num_workers
    solver.parameters.random_seed = config.seed
    solver.parameters.max_time_in_seconds = max(wall_s, 1e-3)
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = deterministic_s
    return solver


def _to_units(seconds: float) -> int:
    return round(float(seconds) * TIME_UNITS_PER_S)


# --------------------------------------------------------------------------- exact model
def all_multisets(sizes: list[int], total: int) -> list[list[int]]:
    """Every multiset of ``sizes`` summing to ``total`` (descending lists)."""
    out: list[list[int]] = []

    def rec(rest: int, largest_index: int, acc: list[int]) -> None:
        if rest == 0:
            out.append(list(acc))
            return
        for j in range(largest_index, -1, -1):
            d = sizes[j]
            if d <= rest:
                acc.append(d)
                rec(rest - d, j, acc)
                acc.pop()

    rec(total, len(sizes) - 1, [])
    return out


@dataclass(slots=True)
class _ExactModel:
    model: cp_model.CpModel
    placed: list[tuple[int, int]]
    y: dict[tuple[int, int, int], cp_model.IntVar]
    k: list[cp_model.IntVar]
    makespan: cp_model.IntVar


def build_exact_model(table: CostTable, placed: list[tuple[int, int]]) -> _ExactModel | None:
    """The exact per-sample model for one placement (None if some sample fits no group)."""
    cm = table.cost_model
    samples = table.samples
    n, layers = len(samples), table.num_layers
    gpn = cm.cluster.gpus_per_node
    budget = math.floor(table.budget_bytes)
    tokens = np.array([s.tokens for s in samples], dtype=np.float64)
    frames = np.array([s.num_frames for s in samples], dtype=np.float64)
    spatial = np.array([s.spatial_tokens for s in samples], dtype=np.float64)
    model = cp_model.CpModel()
    # Recomputing every layer is dominated by recomputing all but the last (no less memory at
    # the peak, more time; CostModel.activation_bytes), so policies range over 0..k_top.
    k_top = max(layers - 1, 0)
    # k[i]: layers sample i recomputes; z[i] = 1 if k[i] >= 1.
    k = [model.new_int_var(0, k_top, f"k[{i}]") for i in range(n)]
    z = [model.new_bool_var(f"z[{i}]") for i in range(n)]
    for i in range(n):
        model.add(k[i] <= layers * z[i])
        model.add(k[i] >= z[i])
    y: dict[tuple[int, int, int], cp_model.IntVar] = {}  # y[i, g, m]: i in micro-batch m of g
    loads = []
    horizon = 0
    for g, (d, first) in enumerate(placed):
        nodes = nodes_spanned(first_rank=first, group_size=d, gpus_per_node=gpn)
        t0 = cm.sample_time_s(tokens, group_size=d, recompute_layers=0, frames=frames,
                              spatial=spatial, num_nodes=nodes)
        tl = cm.sample_time_s(tokens, group_size=d, recompute_layers=layers, frames=frames,
                              spatial=spatial, num_nodes=nodes)
        a0 = cm.activation_bytes(tokens, group_size=d, recompute_layers=0)
        a1 = cm.activation_bytes(tokens, group_size=d, recompute_layers=min(1, k_top))
        al = cm.activation_bytes(tokens, group_size=d, recompute_layers=k_top)
        slope = (a1 - al) / max(k_top - 1, 1)  # bytes saved per further recomputed layer
        # act(k) = a0 + z*jump - k*slope for every k in 0..k_top. jump is 0 up to rounding when
        # L >= 3 and negative (a1 < a0) when L = 2 (k_top = 1, slope 0): kept with its sign, and
        # rounded up like every byte term so that what the model accepts fits.
        jump = a1 + slope - a0
        # A used slot costs its fixed part with one policy throughout, plus one forward+backward
        # call per layer where its policies differ and one recompute call per recomputed layer.
        o = _to_units(cm.microbatch_fixed_s(group_size=d, num_nodes=nodes))
        call_f, call_b = cm.layer_call_s(group_size=d, num_nodes=nodes)
        mixed_units, recompute_units = _to_units(call_f + call_b), _to_units(call_f)
        time_terms = []
        used_prev: cp_model.IntVar | None = None
        for m in range(n):
            used = model.new_bool_var(f"u[{g},{m}]")  # micro-batch slot m of g is used
            hi = model.new_int_var(0, layers, f"hi[{g},{m}]")  # >= the slot's largest k
            lo = model.new_int_var(0, layers, f"lo[{g},{m}]")  # <= the slot's smallest k
            model.add(lo <= layers * used)
            mem_terms = []
            members = []
            for i in range(m, n):  # symmetry: slot m holds samples with index >= m only
                if al[i] > table.budget_bytes:
                    continue  # cannot fit this group under any policy
                var = model.new_bool_var(f"y[{i},{g},{m}]")
                y[i, g, m] = var
                members.append(var)
                ky = model.new_int_var(0, k_top, f"ky[{i},{g},{m}]")
                model.add(ky == k[i]).only_enforce_if(var)
                model.add(ky == 0).only_enforce_if(~var)
                zy = model.new_bool_var(f"zy[{i},{g},{m}]")
                model.add_bool_and([var, z[i]]).only_enforce_if(zy)
                model.add_bool_or([~var, ~z[i], zy])
                mem_terms += [math.ceil(a0[i]) * var, math.ceil(jump[i]) * zy,
                              -math.floor(max(slope[i], 0.0)) * ky]
                rec = (tl[i] - t0[i]) / max(layers, 1)
                time_terms += [_to_units(t0[i]) * var, _to_units(rec) * ky]
                model.add(hi >= ky)
                model.add(lo <= k[i]).only_enforce_if(var)
                model.add_implication(var, used)
                horizon += _to_units(tl[i])
            if not members:
                model.add(used == 0)
            else:
                model.add(sum(members) >= used)
                model.add(sum(mem_terms) <= budget)
            time_terms += [o * used, mixed_units * hi - mixed_units * lo, recompute_units * hi]
            if used_prev is not None:
                model.add(used <= used_prev)  # used slots come first
            used_prev = used
            horizon += o + (mixed_units + recompute_units) * layers
        loads.append(time_terms)
    for i in range(n):
        choices = [v for (j, _, _), v in y.items() if j == i]
        if not choices:
            return None
        model.add_exactly_one(choices)
    makespan = model.new_int_var(0, max(horizon, 1), "makespan")
    for terms in loads:
        model.add(sum(terms) <= makespan)
    model.minimize(makespan)
    return _ExactModel(model=model, placed=placed, y=y, k=k, makespan=makespan)


def _hint_exact(em: _ExactModel, hint: Draft) -> None:
    """Hint the heuristic's draft when its placement is this model's."""
    by_first = {first: g for g, (_, first) in enumerate(em.placed)}
    if sorted((g.size, g.first_rank) for g in hint) != sorted(em.placed):
        return
    for group in hint:
        g = by_first[group.first_rank]
        for mb in group.micro_batches:
            for i, k in mb:
                em.model.add_hint(em.k[i], k)
        # Slots are ordered by their lowest sample index (the model's symmetry breaking).
        slots = sorted(group.micro_batches, key=lambda mb: min(i for i, _ in mb))
        for m, mb in enumerate(slots):
            for i, _ in mb:
                if (i, g, m) in em.y:
                    em.model.add_hint(em.y[i, g, m], True)


def _decode_exact(em: _ExactModel, solver: cp_model.CpSolver) -> Draft:
    groups: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for (i, g, m), var in em.y.items():
        if solver.boolean_value(var):
            groups.setdefault(g, {}).setdefault(m, []).append((i, int(solver.value(em.k[i]))))
    draft: Draft = []
    for g, (d, first) in enumerate(em.placed):
        mbs = [sorted(groups[g][m]) for m in sorted(groups.get(g, {}))]
        draft.append(DraftGroup(size=d, first_rank=first, micro_batches=mbs))
    return draft


def solve_exact(table: CostTable, hint: Draft, *, config: PlannerConfig, deadline: float
                ) -> CpsatResult:
    """Solve the exact model over every placeable multiset; OPTIMAL when all are proven."""
    cluster = table.cost_model.cluster
    placements = []
    for ms in all_multisets(table.sizes, cluster.num_gpus):
        placed = place_groups(ms, num_gpus=cluster.num_gpus, gpus_per_node=cluster.gpus_per_node)
        if placed is not None:
            placements.append(placed)
    best: tuple[float, Draft] | None = None
    bound = math.inf
    proven = True
    for idx, placed in enumerate(placements):
        em = build_exact_model(table, placed)
        if em is None:
            continue
        _hint_exact(em, hint)
        left = deadline - time.perf_counter()
        solver = _solver(config, wall_s=left / max(len(placements) - idx, 1), deterministic_s=None)
        status = solver.solve(em.model)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            value = solver.objective_value / TIME_UNITS_PER_S
            if best is None or value < best[0]:
                best = (value, _decode_exact(em, solver))
        if status == cp_model.INFEASIBLE:
            continue
        proven &= status == cp_model.OPTIMAL
        bound = min(bound, solver.best_objective_bound / TIME_UNITS_PER_S
                    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else 0.0)
    if best is None:
        return CpsatResult(draft=None, status="UNKNOWN", method="cpsat-exact", bound_s=None)
    # Integer rounding of times: the proven bound is exact up to half a unit per term.
    slack = (len(table.samples) * 2 + 1) / TIME_UNITS_PER_S
    return CpsatResult(draft=best[1], status="OPTIMAL" if proven else "FEASIBLE",
                       method="cpsat-exact",
                       bound_s=max(0.0, bound - slack) if math.isfinite(bound) else None)


def improve(table: CostTable, hint: Draft, *, config: PlannerConfig, deadline: float
            ) -> CpsatResult:
    """Run what suits the batch size, seeded with the heuristic's draft: the exact model on
    tiny batches, the large-neighbourhood search (``planner.search.lns``) otherwise."""
    if is_exact_size(table, config):
        return solve_exact(table, hint, config=config, deadline=deadline)
    if not config.aggregated_cpsat or time.perf_counter() >= deadline:
        return CpsatResult(draft=None, status="UNKNOWN", method="cpsat-lns", bound_s=None)
    draft, stats = lns(table, hint, config=config, deadline=deadline)
    return CpsatResult(draft=draft if stats.improved_rounds else None,
                       status="FEASIBLE" if stats.improved_rounds else "UNKNOWN",
                       method="cpsat-lns", bound_s=None, lns=stats)
