"""``plan_batch``: one step's plan, jointly choosing group sizes, placement, micro-batches and
checkpoint policies (docs/design.md, 'The optimisation').

Pipeline: check the input; tabulate costs per sample class and allowed size; compute the lower
bounds; run the heuristic (candidate multisets, LPT, local search) and lay its groups out with
per-micro-batch policies (``search.intra``); hand its draft to CP-SAT as a hint (the exact
per-sample model for tiny batches, the large-neighbourhood search otherwise) and keep CP-SAT's
plan only when it is better; compute the baselines, and where one is predicted faster, polish
its groups with the local search (or return it as is). Under ``layout="auto"`` the same search
also runs on the pure-Ulysses table, and its plan is kept where faster, so ``auto`` is never
predicted slower than ``ulysses``; on large batches where the two problems' bounds are close, the
Ulysses plan (relaid out, against ``auto``'s baselines) takes the place of the layout search
(``PlannerConfig.ulysses_seeded_min_samples``). Every returned plan passes ``validate_plan``: its policies and
micro-batch peaks are checked before it is returned (``planner.checks``; a failure raises).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.assemble import Draft, PlanMeta, assemble_plan, draft_step_time_s
from planner.baselines import baseline_drafts, with_layouts
from planner.bounds.check import PROVEN_STATUS, bound_problem, plan_witnesses_tie
from planner.bounds.patterns import PatternMemo
from planner.checks import (  # noqa: F401  (BoundError, check_bound, InvalidPlanError: re-exported)
    BOUND_REL_TOL,
    BoundError,
    InvalidPlanError,
    batch_digest,
    check_bound,
    check_draft,
)
from planner.config import PlannerConfig
from planner.gc_pause import paused_gc
from planner.layouts import (
    apply_layouts,
    choose_group_layouts,
    in_node_ring_margin,
    ring_chunks_fit,
    ring_savings_s,
)
from planner.plan import LowerBound, Plan, SolverStatus
from planner.prepare import Prepared, prepare
from planner.search.heuristic import heuristic_plan
from planner.search.intra import intra_draft
from planner.search.polish import polish
from planner.search_stats import SearchStats

logger = logging.getLogger(__name__)


def _valid_best(candidates: Sequence[tuple[str, float]], plan_step_time_s: float, *, status: str,
                tie_witnessed: bool, samples: Sequence[Sample], config: PlannerConfig, stats: SearchStats
                ) -> tuple[float, str]:
    """The largest of the ``(kind, seconds)`` bounds. A wrong bound (``bound_problem``: above the
    plan's step time, or equal to it on a plan not ``OPTIMAL``) raises ``BoundError``
    (``config.strict_bounds``), or is dropped: logged at ERROR with the batch's digest, its kind
    added to ``stats.dropped_bounds``; the largest valid one is returned."""
    best: tuple[float, str] = (0.0, "none")
    for kind, value in candidates:
        problem = bound_problem(value, kind, plan_step_time_s, status=status, tie_witnessed=tie_witnessed)
        if problem is not None:
            if config.strict_bounds:
                check_bound(value, kind, plan_step_time_s, status=status, tie_witnessed=tie_witnessed)
            logger.error("%s: dropped (batch %s, %d samples)", problem, batch_digest(samples), len(samples))
            stats.dropped_bounds = (*stats.dropped_bounds, kind)
        elif value >= best[0]:
            best = (value, kind)
    return best


def plan_batch(samples: Sequence[Sample], *, cluster: ClusterSpec, cost_model: CostModelFile,
               config: PlannerConfig | None = None, step: int | None = None,
               reference_sample: Sample | None = None) -> Plan:
    """Plan one optimizer step (``plan_batch_with_stats`` without the statistics)."""
    return plan_batch_with_stats(samples, cluster=cluster, cost_model=cost_model, config=config,
                                 step=step, reference_sample=reference_sample)[0]


def plan_batch_with_stats(samples: Sequence[Sample], *, cluster: ClusterSpec,
                          cost_model: CostModelFile, config: PlannerConfig | None = None,
                          step: int | None = None, reference_sample: Sample | None = None
                          ) -> tuple[Plan, SearchStats]:
    """Plan one optimizer step.

    Args:
        samples: The global batch, in sampler order (ids unique).
        cluster: The world the plan is for.
        cost_model: The cost-model file (bound to ``cluster`` here).
        config: Search settings (default ``PlannerConfig()``).
        step: Step index recorded in the plan.
        reference_sample: The workload's longest sample: a bucket baseline's SP size, fixed
            for the whole run, must hold it (default: only the batch's samples are checked).

    Returns:
        A valid plan with its lower bound, solver status and every baseline's predicted step
        time (never predicted slower than a baseline it computed), and how it was found.

    Raises:
        ValueError: see ``prepare``.
        BoundError: when a lower bound exceeds the plan's own predicted step time (a bug).
    """
    with paused_gc():  # 20-30% of a large plan's time was the cyclic collector (planner.gc_pause)
        return _plan_batch_with_stats(samples, cluster=cluster, cost_model=cost_model, config=config, step=step,
                                      reference_sample=reference_sample)


@dataclass(slots=True)
class _Found:
    """What one search over a prepared batch found (before its bounds and assembly)."""

    draft: Draft
    step_time_s: float
    status: SolverStatus
    method: str
    solver_bound_s: float | None
    """CP-SAT's proven bound of the compute makespan, if it ran."""
    baselines_s: dict[str, float]
    cpsat_proved: bool = False
    """CP-SAT proved this very plan optimal (the only source of the bound kind ``cpsat-optimal``)."""
    pattern_memo: PatternMemo | None = None
    """The pattern enumerations of the cover search on the prepared table (``planner.bounds.patterns``),
    for the pattern bound to share where that table is its own bounds' view (no ring)."""


def _plan_batch_with_stats(samples: Sequence[Sample], *, cluster: ClusterSpec, cost_model: CostModelFile,
                           config: PlannerConfig | None, step: int | None, reference_sample: Sample | None
                           ) -> tuple[Plan, SearchStats]:
    start = time.perf_counter()
    config = config or PlannerConfig()
    prep = prepare(samples, cluster=cluster, cost_model=cost_model, config=config)
    stats = SearchStats()
    candidate = config.layout == "auto" and config.ulysses_candidate and prep.table.has_ring
    seeded = candidate and config.ulysses_seeded_min_samples is not None and (
        len(samples) >= config.ulysses_seeded_min_samples)
    u_prep = _ulysses_prepare(prep, samples, config=config) if seeded else None
    if u_prep is not None and u_prep.bounds.best_s <= prep.bounds.best_s * (1 + config.ulysses_seeded_max_bound_gain):
        found = _from_ulysses_plan(prep, u_prep, samples, config=config, reference_sample=reference_sample,
                                   stats=stats)
    else:
        found = _search(prep, samples, config=config, start=start, reference_sample=reference_sample, stats=stats)
        if candidate and not seeded:  # prepared after the search, as CP-SAT's deadline counts from the start
            u_prep = _ulysses_prepare(prep, samples, config=config)
        if u_prep is not None:
            found = _with_ulysses_candidate(found, prep, u_prep, samples, config=config,
                                            reference_sample=reference_sample, stats=stats)
    return _finish(found, prep, samples, config=config, start=start, step=step, stats=stats)


def _ulysses_prepare(prep: Prepared, samples: Sequence[Sample], *, config: PlannerConfig) -> Prepared | None:
    """The batch prepared as ``layout="ulysses"`` prepares it; None when a sample fits no
    pure-Ulysses group (or no world partition): only rings hold it."""
    try:
        return prepare(samples, cluster=prep.cost_model.cluster, cost_model=prep.cost_model.file,
                       config=dataclasses.replace(config, layout="ulysses"))
    except ValueError:
        return None


def _ulysses_search(u_prep: Prepared, samples: Sequence[Sample], *, config: PlannerConfig,
                    reference_sample: Sample | None) -> _Found:
    """The search ``layout="ulysses"`` runs on the batch (``u_prep``: ``_ulysses_prepare``'s)."""
    return _search(u_prep, samples, config=dataclasses.replace(config, layout="ulysses"), start=time.perf_counter(),
                   reference_sample=reference_sample, stats=SearchStats())


def _from_ulysses_plan(prep: Prepared, u_prep: Prepared, samples: Sequence[Sample], *, config: PlannerConfig,
                       reference_sample: Sample | None, stats: SearchStats) -> _Found:
    """Under ``layout="auto"`` at ``PlannerConfig.ulysses_seeded_min_samples`` and above, where the
    pure-Ulysses problem's bound is near the layout problem's: the plan ``layout="ulysses"`` makes
    of the batch, each group then at its size's fastest layout (``choose_group_layouts``, never
    slower), against ``auto``'s baselines (``_with_baselines``). Its bounds and CP-SAT proof are
    of the Ulysses problem only, so none is kept."""
    u_found = _ulysses_search(u_prep, samples, config=config, reference_sample=reference_sample)
    table, arrays, cm = prep.table, prep.arrays, prep.cost_model
    stats.ulysses_step_time_s = u_found.step_time_s
    margin = in_node_ring_margin(config, cm)
    u_draft = choose_group_layouts(u_found.draft, arrays, table, in_node_margin=margin)
    u_time = draft_step_time_s(u_draft, arrays, cm, grad_sync_s=table.grad_sync_s)
    stats.heuristic_step_time_s = stats.search_step_time_s = u_time
    u_status: SolverStatus = "FEASIBLE" if u_found.status == "OPTIMAL" else u_found.status
    u_method = f"ulysses:{u_found.method}"
    draft, best_time, status, method, baselines = _with_baselines(
        prep, samples, u_draft, u_time, u_status, u_method, config=config, reference_sample=reference_sample,
        stats=stats)
    if status == "POLISHED_BASELINE":  # in the table's layouts: each group re-chosen where that is faster
        chosen = choose_group_layouts(draft, arrays, table, in_node_margin=margin)
        chosen_time = draft_step_time_s(chosen, arrays, cm, grad_sync_s=table.grad_sync_s)
        if chosen_time < best_time:
            draft, best_time = chosen, chosen_time
    return _Found(draft=draft, step_time_s=best_time, status=status, method=method, solver_bound_s=None,
                  baselines_s=baselines)


def _with_ulysses_candidate(found: _Found, prep: Prepared, u_prep: Prepared, samples: Sequence[Sample], *,
                            config: PlannerConfig, reference_sample: Sample | None, stats: SearchStats) -> _Found:
    """Under ``layout="auto"``: the search's result, or the plan ``layout="ulysses"`` makes of the same
    batch where that is faster (the same search on the pure-Ulysses table, its own baselines and polish),
    each of its groups then at the fastest layout of its size (``choose_group_layouts``, never slower).
    So ``auto`` is never predicted slower than ``ulysses``. The Ulysses search is skipped where the
    Ulysses problem's lower bound (``prepare``'s, cheap) already reaches the search's step time.
    The Ulysses run's own bounds and CP-SAT proof are of the Ulysses problem only: the plan keeps
    ``auto``'s."""
    if u_prep.bounds.best_s >= found.step_time_s:  # no Ulysses plan can be faster: skip its search
        stats.ulysses_bound_s = u_prep.bounds.best_s
        return found
    u_found = _ulysses_search(u_prep, samples, config=config, reference_sample=reference_sample)
    stats.ulysses_step_time_s = u_found.step_time_s
    if not u_found.step_time_s < found.step_time_s * (1 - 1e-9):
        return found
    table, arrays, cm = prep.table, prep.arrays, prep.cost_model
    draft = choose_group_layouts(u_found.draft, arrays, table, in_node_margin=in_node_ring_margin(config, cm))
    status: SolverStatus = "FEASIBLE" if u_found.status == "OPTIMAL" else u_found.status
    logger.debug("layout=auto: the pure-Ulysses plan (%.6f s) beats the search's (%.6f s)", u_found.step_time_s,
                 found.step_time_s)
    return _Found(draft=draft, step_time_s=draft_step_time_s(draft, arrays, cm, grad_sync_s=table.grad_sync_s),
                  status=status, method=f"ulysses:{u_found.method}", solver_bound_s=found.solver_bound_s,
                  baselines_s=found.baselines_s)


def _search(prep: Prepared, samples: Sequence[Sample], *, config: PlannerConfig, start: float,
            reference_sample: Sample | None, stats: SearchStats) -> _Found:
    """The heuristic, CP-SAT, the baselines (and the polish of one that wins) and, with rings, each
    group's layout: the plan's draft and where it came from (``stats`` filled on the way)."""
    cm, table, arrays = prep.cost_model, prep.table, prep.arrays
    cluster = cm.cluster
    draft, _ = heuristic_plan(table, makespan_hint_s=prep.bounds.compute_makespan_s,
                              num_candidates=config.num_candidate_partitions,
                              num_lpt_runs=config.num_lpt_runs,
                              max_moves=config.local_search_max_moves,
                              num_refined=config.num_refined,
                              num_target_probes=config.num_target_probes,
                              bucket_tolerance=config.bucket_tolerance,
                              max_ejections=config.local_search_max_ejections,
                              max_resizes=config.max_resize_tries,
                              deep_min_gap=config.deep_search_min_gap)
    if config.intra_policies and not config.intra_search:
        draft = intra_draft(table, draft)
    draft = apply_layouts(draft, table)
    best_time = draft_step_time_s(draft, arrays, cm, grad_sync_s=table.grad_sync_s)
    stats.heuristic_step_time_s = best_time
    status: SolverStatus = "HEURISTIC"
    method = "heuristic"
    solver_bound: float | None = None
    cpsat_proved = False
    if config.use_cpsat and (config.aggregated_cpsat or (
            len(samples) <= config.exact_max_samples and cluster.num_gpus <= config.exact_max_ranks)):
        from planner.search import cpsat  # the only module that imports ortools

        deadline = start + (config.exact_time_limit_s if cpsat.is_exact_size(table, config)
                            else config.time_limit_s)
        result = cpsat.improve(table, draft, config=config, deadline=deadline)
        solver_bound = result.bound_s
        cpsat_proved = result.status == "OPTIMAL"
        if result.lns is not None:
            stats.lns_rounds, stats.lns_improved_rounds = (result.lns.rounds,
                                                           result.lns.improved_rounds)
        if result.draft is not None:
            cand = result.draft
            if config.intra_policies and result.method != "cpsat-exact":  # exact: policies inside
                cand = intra_draft(table, cand)
            cand = apply_layouts(cand, table)
            cand_time = draft_step_time_s(cand, arrays, cm, grad_sync_s=table.grad_sync_s)
            stats.cpsat_step_time_s = cand_time
            stats.cpsat_improved = cand_time < best_time * (1 - 1e-9)
            if cand_time < best_time * (1 - 1e-9) or (
                    result.status == "OPTIMAL" and cand_time <= best_time * (1 + 1e-9)):
                draft, best_time = cand, cand_time
                status = "OPTIMAL" if result.status == "OPTIMAL" else "FEASIBLE"
                method = result.method
            elif result.status == "OPTIMAL":
                status, method = "OPTIMAL", result.method  # the hint was already optimal
    pattern_memo: PatternMemo | None = None
    # a plan within cover_min_gap of the simple bound (or, below, of the pattern threshold), in step
    # time, leaves the cover at most that much to gain
    near_simple = best_time <= prep.bounds.best_s * (1 + config.cover_min_gap)
    if config.cover_search and len(samples) <= config.pattern_bound_max_samples and not (
            config.cover_min_gap > 0 and near_simple):
        from planner.search.cover import cover_draft  # imports scipy's MILP solver

        # whole groups of the pattern cover at the least deadline found, packed and polished
        pattern_memo = PatternMemo()
        cover = cover_draft(table, lower_s=prep.bounds.compute_makespan_s, iterations=config.pattern_bound_iterations,
                            max_visits=config.pattern_max_visits, max_moves=config.local_search_max_moves,
                            intra=config.intra_policies, memo=pattern_memo,
                            skip_within_s=best_time / (1 + config.cover_min_gap) - table.grad_sync_s
                            if config.cover_min_gap > 0 else None)
        if cover is not None:
            cover = apply_layouts(cover, table)
            cover_time = draft_step_time_s(cover, arrays, cm, grad_sync_s=table.grad_sync_s)
            stats.cover_step_time_s = cover_time
            if cover_time < best_time * (1 - 1e-9):
                draft, best_time, status, method = cover, cover_time, "HEURISTIC", "cover"
    stats.search_step_time_s = best_time
    draft, best_time, status, method, baselines = _with_baselines(
        prep, samples, draft, best_time, status, method, config=config, reference_sample=reference_sample,
        stats=stats)
    if table.has_ring and status not in ("BASELINE",):
        # each group's layout for its own samples and placement, exactly (never slower)
        chosen = choose_group_layouts(draft, arrays, table, in_node_margin=in_node_ring_margin(config, cm))
        best_time = draft_step_time_s(chosen, arrays, cm, grad_sync_s=table.grad_sync_s)
        draft = chosen
    return _Found(draft=draft, step_time_s=best_time, status=status, method=method, solver_bound_s=solver_bound,
                  baselines_s=baselines, cpsat_proved=cpsat_proved and status == PROVEN_STATUS,
                  pattern_memo=pattern_memo)


def _with_baselines(prep: Prepared, samples: Sequence[Sample], draft: Draft, best_time: float,
                    status: SolverStatus, method: str, *, config: PlannerConfig, reference_sample: Sample | None,
                    stats: SearchStats) -> tuple[Draft, float, SolverStatus, str, dict[str, float]]:
    """Every baseline's step time on the prepared table and, where the fastest beats the given
    plan, that baseline (polished by the search's moves where that helps) in its place."""
    cm, table, arrays = prep.cost_model, prep.table, prep.arrays
    limit_bytes = _limit_bytes(prep)
    baselines: dict[str, float] = {}
    baseline_best: tuple[float, str, Draft] | None = None
    if config.compute_baselines:
        extra = () if config.baseline_group_size is None else (config.baseline_group_size,)
        missed: list[str] = []
        for name, b_draft in baseline_drafts(table, seed=config.seed, reference=reference_sample,
                                             extra_bucket_sizes=extra, not_holding=missed).items():
            b_draft = with_layouts(name, b_draft, table)  # ring-cp, usp: their own
            if not ring_chunks_fit(b_draft, arrays):  # a sample too short for its group's ring
                missed.append(name)
                continue
            check_draft(b_draft, arrays, cm, limit_bytes=limit_bytes, what=f"baseline {name!r}", samples=samples)
            t = draft_step_time_s(b_draft, arrays, cm, grad_sync_s=table.grad_sync_s)
            baselines[name] = t
            if baseline_best is None or t < baseline_best[0]:
                baseline_best = (t, name, b_draft)
        stats.baselines_not_holding = tuple(missed)
        if missed:
            logger.debug("baselines that cannot hold this batch (left out of the strongest): %s", ", ".join(missed))
    if baseline_best is not None:
        stats.strongest_baseline_step_time_s = baseline_best[0]
    if baseline_best is not None and baseline_best[0] < best_time:
        logger.info("baseline %s (%.6f s) beats the planner (%.6f s)", baseline_best[1],
                    baseline_best[0], best_time)
        best_time, method, draft = baseline_best[0], baseline_best[1], baseline_best[2]
        status = "BASELINE"
        if config.polish_baseline:
            # The search's own moves and intra policies, seeded with the baseline's groups.
            # (None: the baseline runs a sample where the table's layout of its size cannot.)
            polished = polish(table, draft, max_moves=config.local_search_max_moves, intra=config.intra_policies)
            if polished is not None:
                polished = apply_layouts(polished, table)
            t = draft_step_time_s(polished, arrays, cm, grad_sync_s=table.grad_sync_s) if polished else best_time
            if polished is not None and t < best_time * (1 - 1e-9):
                stats.polished_from_s = best_time
                best_time, draft = t, polished
                status, method = "POLISHED_BASELINE", f"{baseline_best[1]}+search"
    return draft, best_time, status, method, baselines


def _limit_bytes(prep: Prepared) -> float:
    """Every micro-batch's peak, at most: model states plus the table's activation budget."""
    return prep.cost_model.fixed_bytes() + prep.table.budget_bytes


def _finish(found: _Found, prep: Prepared, samples: Sequence[Sample], *, config: PlannerConfig, start: float,
            step: int | None, stats: SearchStats) -> tuple[Plan, SearchStats]:
    """The plan of what the search found: its lower bound, checks and assembly."""
    cm, table, arrays = prep.cost_model, prep.table, prep.arrays
    draft, best_time, status, method = found.draft, found.step_time_s, found.status, found.method
    solver_bound, baselines, cpsat_proved = found.solver_bound_s, found.baselines_s, found.cpsat_proved
    check_draft(draft, arrays, cm, limit_bytes=_limit_bytes(prep), what=f"the plan ({method})", samples=samples)
    meta = PlanMeta(status=status, method=method, wall_time_s=0.0, lower_bound=LowerBound(value_s=0.0, kind="none"),
                    objective_bound_s=None if solver_bound is None
                    else solver_bound + table.grad_sync_s,
                    seed=config.seed, step=step, loss_normalization=config.loss_normalization,
                    baselines_s=baselines)
    plan = assemble_plan(draft, samples, cost_model=cm, meta=meta, arrays=arrays)
    if table.has_ring:  # why each ring: its saving against pure Ulysses of its size (plan groups by first rank)
        savings = ring_savings_s(sorted(draft, key=lambda g: g.first_rank), arrays, cm, limit_bytes=_limit_bytes(prep))
        plan = plan.model_copy(update={"groups": [g if s is None else g.model_copy(update={"ring_saving_s": s})
                                                  for g, s in zip(plan.groups, savings, strict=True)]})
    witnessed = plan_witnesses_tie(plan)  # may a simple bound meet this plan's time (planner.bounds.check)
    report = prep.bounds
    # In tie order (a later one wins a tie): CP-SAT's only when strictly higher, then the most
    # specific simple bound (BoundReport.best_kind's rule).
    candidates = [("cpsat", solver_bound + table.grad_sync_s)] if solver_bound is not None else []
    candidates += [("area", report.area_s), ("longest", report.longest_s),
                   ("largest-choice", report.largest_choice_s), ("deadline-area", report.deadline_area_s)]
    bound_value, bound_kind = _valid_best(candidates, best_time, status=status, tie_witnessed=witnessed,
                                          samples=samples, config=config, stats=stats)
    if (config.lp_bound_iterations > 0 and status != "OPTIMAL"
            and best_time > bound_value * (1 + config.lp_bound_min_gap)):
        from planner.bounds.lp import partition_lp_bound  # imports scipy's LP solver

        # Work limits sized for 256 samples: fewer steps on larger batches, and the plain LP
        # instead of the MIP (0.05-0.1 s per solve at 256 distinct lengths, 0.3 s at 1024)
        # above 64 sample classes.
        # With rings, on the bounds' view of the table (each size's least time over its layouts,
        # a ring's additive parts only; the LP takes the same least over layouts of its inputs).
        lp = partition_lp_bound(  # its bracket comes from the problem, not from best_time
            table.for_bounds(), lower_s=bound_value - table.grad_sync_s,
            iterations=max(1, round(config.lp_bound_iterations * min(1.0, 256 / len(samples)))),
            integral_groups=config.lp_bound_integral and table.classes.num_classes <= 64,
            micro_batch_buckets=config.lp_bound_micro_batch_buckets, max_classes=config.lp_bound_max_classes,
            rel_tol=config.lp_bound_rel_tol,
        ) + table.grad_sync_s
        if lp > bound_value:
            bound_value, bound_kind = _valid_best([("partition-lp", lp), (bound_kind, bound_value)], best_time,
                                                  status=status, tie_witnessed=witnessed, samples=samples,
                                                  config=config, stats=stats)
    if (config.pattern_bound_iterations > 0 and status != "OPTIMAL"
            and len(samples) <= config.pattern_bound_max_samples
            and best_time > bound_value * (1 + config.pattern_bound_min_gap)):
        from planner.bounds.patterns import pattern_bound  # imports scipy's LP solver

        # whole samples per group: a configuration LP from the bound so far (never the plan's time);
        # on a table that is its own bounds' view, the cover search's threshold (the same bound)
        bounds_view, memo = table.for_bounds(), found.pattern_memo
        if memo is not None and bounds_view is table and memo.bound_s is not None:
            patterns = memo.bound_s + table.grad_sync_s
        else:
            patterns = pattern_bound(bounds_view, lower_s=bound_value - table.grad_sync_s,
                                     iterations=config.pattern_bound_iterations, max_visits=config.pattern_max_visits,
                                     memo=memo if bounds_view is table else None) + table.grad_sync_s
        if patterns > bound_value:
            bound_value, bound_kind = _valid_best([("patterns", patterns), (bound_kind, bound_value)], best_time,
                                                  status=status, tie_witnessed=witnessed, samples=samples,
                                                  config=config, stats=stats)
    if status == PROVEN_STATUS and cpsat_proved and best_time > bound_value:  # CP-SAT's own proof
        bound_value, bound_kind = best_time, "cpsat-optimal"
    check_bound(bound_value, bound_kind, best_time, status=status, tie_witnessed=witnessed)
    plan = plan.model_copy(update={"lower_bound": LowerBound(value_s=bound_value, kind=bound_kind)})
    return plan.model_copy(update={"solver": plan.solver.model_copy(
        update={"wall_time_s": time.perf_counter() - start})}), stats
