"""Large-neighbourhood search: CP-SAT re-solves sub-problems of the incumbent plan exactly.

Each round frees the micro-batches of a few groups (the slowest group, the least loaded ones and
one drawn at random, up to ``lns_max_samples`` samples) and gives CP-SAT the sub-problem: which
of those groups runs each freed sample, in which micro-batch, under which policy, so that the
slowest of these groups (then their GPU-seconds) is as low as possible; everything else of the
plan stays. The model (``build_model``) is exact for the freed part under the search's cost rows
(aligned placement): per sample, group and micro-batch slot a boolean ``y`` and a policy ``k``
(time ``time0 + k * r``, bytes ``mem0 - k * b``, ``0 <= k <= L - 1``), per slot the overhead if
used and the recompute calls of its largest ``k`` (plus the split calls, counted as if its
smallest ``k`` were 0: an upper bound), each slot's bytes under the budget, and per group the
time of its kept micro-batches as a constant. Seeded with the incumbent as a complete hint;
each solve has a deterministic time limit; a round's result is laid out again per group
(``intra.intra_layout``, the cheaper of the two) and kept only when it lowers the slowest
touched group (or keeps it and lowers their GPU-seconds) without raising the plan's makespan.
Deterministic: rounds and solves are work-limited; the wall clock is only a safety cap.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.assemble import Draft, DraftGroup
from planner.config import PlannerConfig
from planner.costs import CostTable
from planner.search.intra import Layout, intra_layout, layout_time_s, microbatch_policies

logger = logging.getLogger(__name__)

TIME_UNITS_PER_S = 1_000_000_000
"""Integer time unit of the model: nanoseconds."""


@dataclass(slots=True)
class LnsStats:
    """What the rounds did (for the benchmark)."""

    rounds: int = 0
    """Neighbourhoods solved."""
    improved_rounds: int = 0
    """Rounds whose result was kept."""
    start_makespan_s: float = 0.0
    """Slowest group of the seed draft (search rows, gradient sync excluded)."""
    end_makespan_s: float = 0.0
    """Slowest group after the last round."""


@dataclass(slots=True)
class _Sub:
    """One sub-problem: the groups it touches, their kept micro-batches and freed samples."""

    groups: list[int]  # indices of the touched groups, the slowest first
    kept: dict[int, Layout]  # per touched group, its micro-batches that stay as they are
    freed: list[int]  # samples the model places
    slots: dict[int, int]  # per touched group, micro-batch slots offered (freed + 1)
    current: dict[int, Layout]  # per touched group, its incumbent layout (for the hint)


@dataclass(slots=True)
class _Model:
    model: cp_model.CpModel
    y: dict[tuple[int, int, int], cp_model.IntVar]  # y[i, g, m] = 1: sample i in slot m of g
    k: dict[tuple[int, int, int], cp_model.IntVar]  # k[i, g, m]: its policy there (0 if absent)
    used: dict[tuple[int, int], cp_model.IntVar]  # used[g, m] = 1: slot m of g holds samples
    hi: dict[tuple[int, int], cp_model.IntVar]  # hi[g, m]: largest policy in slot m of g
    load: dict[int, cp_model.IntVar]  # load[g]: time of group g
    makespan: cp_model.IntVar
    load_units: dict[int, int]  # load[g] of the incumbent, in the model's units


def _units(seconds: float) -> int:
    return round(float(seconds) * TIME_UNITS_PER_S)


def build_model(table: CostTable, sub: _Sub, cols: list[int], sizes: list[int]) -> _Model:
    """The exact model of a sub-problem (see the module docstring)."""
    cls = table.classes.class_of
    top = max(table.num_layers - 1, 0)
    # Bytes rounded to the nearest, and the budget loosened by the most that rounding can add
    # to a slot, so the incumbent (feasible in floating point) is a feasible hint; decoded slots
    # are checked in floating point again (``_decode``).
    budget = math.floor(table.budget_bytes) + len(sub.freed) * (top + 1)
    model = cp_model.CpModel()
    y: dict[tuple[int, int, int], cp_model.IntVar] = {}
    k: dict[tuple[int, int, int], cp_model.IntVar] = {}
    used_v: dict[tuple[int, int], cp_model.IntVar] = {}
    hi_v: dict[tuple[int, int], cp_model.IntVar] = {}
    load_v: dict[int, cp_model.IntVar] = {}
    load_units: dict[int, int] = {}
    freed_set = set(sub.freed)
    loads = []
    area_terms = []
    upper = 1
    for g in sub.groups:
        horizon = 0
        j = cols[g]
        t0, r, m0, b, _, _, kmin = table.column(j)
        fixed = _units(layout_time_s(table, j, sub.kept[g]))
        o = _units(table.overhead_s_by_size[j])
        call = _units(table.call_s_by_size[j] + table.call_fwd_s_by_size[j])
        terms = []
        used_prev = None
        for m in range(sub.slots[g]):
            used = model.new_bool_var(f"u[{g},{m}]")  # slot m of group g holds samples
            hi = model.new_int_var(0, top, f"hi[{g},{m}]")  # >= the slot's largest policy
            used_v[g, m], hi_v[g, m] = used, hi
            members, mem_terms = [], []
            for i in sub.freed:
                c = cls[i]
                if kmin[c] < 0:
                    continue  # does not fit this size under any policy
                var = model.new_bool_var(f"y[{i},{g},{m}]")
                kv = model.new_int_var(0, top, f"k[{i},{g},{m}]")
                model.add(kv <= top * var)
                model.add(hi >= kv)
                y[i, g, m], k[i, g, m] = var, kv
                members.append(var)
                mem_terms += [round(m0[c]) * var, -round(max(b[c], 0.0)) * kv]
                terms += [_units(t0[c]) * var, _units(r[c]) * kv]
                horizon += _units(t0[c] + top * r[c])
            if members:
                model.add(sum(mem_terms) <= budget * used)
                model.add_max_equality(used, members)
            else:
                model.add(used == 0)
            if used_prev is not None:
                model.add(used <= used_prev)  # used slots come first
            used_prev = used
            terms += [o * used, call * hi]
            horizon += o + call * top
        upper = max(upper, fixed + horizon + 1)
        load = model.new_int_var(0, fixed + horizon + 1, f"load[{g}]")
        model.add(load == fixed + sum(terms))
        loads.append(load)
        load_v[g] = load
        # The incumbent's value of load[g] (for a complete hint).
        inc = fixed
        for mb in (mb for mb in sub.current[g] if mb and mb[0][0] in freed_set):
            inc += o + call * max(kk for _, kk in mb)
            inc += sum(_units(t0[cls[i]]) + _units(r[cls[i]]) * kk for i, kk in mb)
        load_units[g] = inc
        area_terms.append(sizes[g] * load)
    for i in sub.freed:
        model.add_exactly_one([v for (s, _, _), v in y.items() if s == i])
    makespan = model.new_int_var(0, upper, "makespan")
    model.add_max_equality(makespan, loads)
    # Lexicographic in effect: the slowest touched group first, then GPU-seconds.
    weight = sum(sizes[g] for g in sub.groups) + 1
    model.minimize(weight * makespan + sum(area_terms))
    return _Model(model=model, y=y, k=k, used=used_v, hi=hi_v, load=load_v, makespan=makespan,
                  load_units=load_units)


def _hint(mdl: _Model, sub: _Sub) -> None:
    """The incumbent's freed micro-batches, in order, as slots 0.. of their group."""
    freed_set = set(sub.freed)
    for g in sub.groups:
        freed = [mb for mb in sub.current[g] if mb and mb[0][0] in freed_set]
        pos = {i: (m, kk) for m, mb in enumerate(freed) for i, kk in mb}
        for (i, gg, m), var in mdl.y.items():
            if gg != g:
                continue
            here = pos.get(i)
            on = here is not None and here[0] == m
            mdl.model.add_hint(var, on)
            mdl.model.add_hint(mdl.k[i, gg, m], here[1] if on and here is not None else 0)
        for (gg, m), var in mdl.used.items():
            if gg == g:
                mdl.model.add_hint(var, m < len(freed))
                mdl.model.add_hint(mdl.hi[gg, m], max(kk for _, kk in freed[m]) if m < len(freed)
                                   else 0)
        mdl.model.add_hint(mdl.load[g], mdl.load_units[g])
    mdl.model.add_hint(mdl.makespan, max(mdl.load_units.values()))


def _decode(table: CostTable, mdl: _Model, solver: cp_model.CpSolver, sub: _Sub, cols: list[int]
            ) -> dict[int, Layout] | None:
    """The touched groups' new micro-batches; a slot over the budget in floating point (the
    model's rounding) gets its policies re-chosen (``intra.microbatch_policies``); None when
    one cannot fit."""
    cls = table.classes.class_of
    out: dict[int, Layout] = {}
    for g in sub.groups:
        _, _, m0, b, _, _, _ = table.column(cols[g])
        slots: dict[int, list[tuple[int, int]]] = {}
        for (i, gg, m), var in mdl.y.items():
            if gg == g and solver.boolean_value(var):
                slots.setdefault(m, []).append((i, int(solver.value(mdl.k[i, gg, m]))))
        new: Layout = []
        for m in sorted(slots):
            mb = sorted(slots[m])
            if sum(m0[cls[i]] - k * b[cls[i]] for i, k in mb) > table.budget_bytes * (1 - 1e-9):
                fixed = microbatch_policies(table, cols[g], [i for i, _ in mb])
                if fixed is None:
                    return None
                mb = sorted(fixed[1])
            new.append(mb)
        out[g] = [*sub.kept[g], *new]
    return out


def _neighbourhood(layouts: list[Layout], loads: list[float], *, rng: random.Random,
                   max_samples: int, num_light: int) -> _Sub | None:
    """The slowest group, the ``num_light`` least loaded and one drawn at random: from each,
    whole micro-batches (fewest samples first, ties at random) while the freed samples stay
    within its share of ``max_samples`` (half for the slowest group, the rest split evenly)."""
    order = sorted(range(len(loads)), key=lambda g: (-loads[g], g))
    top = order[0]
    light = [g for g in order[::-1][:num_light] if g != top]
    others = [g for g in order[1:] if g not in light]
    chosen = [top, *light]
    if others:
        chosen.append(rng.choice(others))
    if len(chosen) < 2:
        return None
    share = [max_samples // 2] + [max(1, (max_samples - max_samples // 2) // (len(chosen) - 1))
                                  ] * (len(chosen) - 1)
    freed: list[int] = []
    kept: dict[int, Layout] = {}
    slots: dict[int, int] = {}
    for g, limit in zip(chosen, share, strict=True):
        mbs = sorted(layouts[g], key=lambda mb: (len(mb), rng.random()))
        kept[g] = []
        count = taken = 0
        for mb in mbs:
            if taken + len(mb) <= limit:
                freed += [i for i, _ in mb]
                taken += len(mb)
                count += 1
            else:
                kept[g].append(mb)
        slots[g] = count + 1
    if not freed:
        return None
    return _Sub(groups=chosen, kept=kept, freed=freed, slots=slots,
                current={g: layouts[g] for g in chosen})


def lns(table: CostTable, draft: Draft, *, config: PlannerConfig, deadline: float
        ) -> tuple[Draft, LnsStats]:
    """Improve a draft by CP-SAT re-solving neighbourhoods (see the module docstring)."""
    groups = sorted(draft, key=lambda g: g.first_rank)
    cols = [table.size_index(g.size) for g in groups]
    sizes = [g.size for g in groups]
    layouts: list[Layout] = [[list(mb) for mb in g.micro_batches if mb] for g in groups]
    loads = [layout_time_s(table, cols[g], layouts[g]) for g in range(len(groups))]
    stats = LnsStats(start_makespan_s=max(loads, default=0.0))
    if not groups:
        return draft, stats
    rng = random.Random(config.seed)
    # Rounds sized for 256 samples, as the heuristic's work limits.
    rounds = max(1, round(config.lns_rounds * min(1.0, 256 / max(len(table.samples), 1))))
    for _ in range(rounds):
        if time.perf_counter() >= deadline or len(groups) < 2:
            break
        sub = _neighbourhood(layouts, loads, rng=rng, max_samples=config.lns_max_samples,
                             num_light=config.lns_light_groups)
        if sub is None:
            break
        stats.rounds += 1
        mdl = build_model(table, sub, cols, sizes)
        _hint(mdl, sub)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = config.num_workers
        solver.parameters.random_seed = config.seed
        solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(), 1e-3)
        solver.parameters.max_deterministic_time = config.cpsat_deterministic_time
        status = solver.solve(mdl.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            continue
        new = _decode(table, mdl, solver, sub, cols)
        if new is None:
            continue
        new_loads: dict[int, float] = {}
        for g, layout in new.items():
            t = layout_time_s(table, cols[g], layout)
            t_intra, relaid = intra_layout(table, cols[g], [i for mb in layout for i, _ in mb])
            if t_intra < t:
                t, new[g] = t_intra, relaid
            new_loads[g] = t
        old_max = max(loads[g] for g in sub.groups)
        new_max = max(new_loads.values())
        old_area = sum(sizes[g] * loads[g] for g in sub.groups)
        new_area = sum(sizes[g] * new_loads[g] for g in sub.groups)
        if new_max < old_max * (1 - 1e-9) or (new_max <= old_max * (1 + 1e-12)
                                              and new_area < old_area * (1 - 1e-9)):
            for g in sub.groups:
                layouts[g], loads[g] = new[g], new_loads[g]
            stats.improved_rounds += 1
    stats.end_makespan_s = max(loads, default=0.0)
    logger.debug("lns: %d rounds, %d improved, makespan %.6f -> %.6f s", stats.rounds,
                 stats.improved_rounds, stats.start_makespan_s, stats.end_makespan_s)
    out = [DraftGroup(size=g.size, first_rank=g.first_rank,
                      micro_batches=[sorted(mb) for mb in layouts[idx] if mb])
           for idx, g in enumerate(groups)]
    return out, stats
