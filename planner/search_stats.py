"""``SearchStats``: how ``plan_batch_with_stats`` found its plan, for benchmarks and tests (not
part of the plan)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SearchStats:
    """How a plan was found, for benchmarks (not part of the plan)."""

    heuristic_step_time_s: float = 0.0
    """Step time of the heuristic's draft (intra policies applied), before CP-SAT."""
    cpsat_step_time_s: float | None = None
    """Step time of CP-SAT's draft when it returned one."""
    cpsat_improved: bool = False
    """CP-SAT's draft was kept (faster than the heuristic's)."""
    cover_step_time_s: float | None = None
    """Step time of the whole-cover plan (``planner.search.cover``) when one was made."""
    lns_rounds: int = 0
    """Neighbourhoods the large-neighbourhood search solved."""
    lns_improved_rounds: int = 0
    """Of those, the ones whose result was kept."""
    search_step_time_s: float = 0.0
    """Step time of the search's own best plan (heuristic or CP-SAT), before any baseline."""
    strongest_baseline_step_time_s: float | None = None
    """Step time of the fastest baseline (``naive`` included only if it is the fastest), if computed."""
    polished_from_s: float | None = None
    """When a baseline beat the search and polishing improved it: the baseline's step time."""
    dropped_bounds: tuple[str, ...] = ()
    """Kinds of the lower bounds found above the plan's step time and dropped
    (``PlannerConfig.strict_bounds`` off; each is a bug, logged with the batch digest)."""
    ulysses_step_time_s: float | None = None
    """Under ``layout="auto"``: the step time of the plan ``layout="ulysses"`` makes of the batch (a
    candidate the plan is never slower than); None when not computed (another layout, no ring
    allowed, ``PlannerConfig.ulysses_candidate`` off, a sample no pure-Ulysses group holds, or
    ``ulysses_bound_s`` at or above the plan's step time)."""
    ulysses_bound_s: float | None = None
    """Under ``layout="auto"``, when the pure-Ulysses problem's lower bound is at or above the
    search's step time (no Ulysses plan can be faster, so its search is skipped): that bound."""
    baselines_not_holding: tuple[str, ...] = ()
    """Baselines computed but unable to hold the batch (a sample fits no group of their rule, or
    their layout is one ``PlannerConfig.layout`` does not allow, or a ring would cut a sample into
    more chunks than it has tokens): not in ``Plan.baselines_s``, so not in the strongest."""
