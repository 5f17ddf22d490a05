"""Planner configuration: one frozen, keyword-only dataclass validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SizeMode = Literal["pow2", "any"]
AttentionLayout = Literal["auto", "ulysses", "ring"]
LossNormalization = Literal["tokens", "samples"]


@dataclass(kw_only=True, frozen=True, slots=True)
class PlannerConfig:
    """How ``plan_batch`` searches.

    Determinism: every search limit that can change the plan is a *work* limit (heuristic
    candidate and move counts, CP-SAT's deterministic time), never wall time, so the same input
    and seed give a byte-identical plan apart from ``solver.wall_time_s`` (see
    ``planner.plan.Plan.content_digest``). ``time_limit_s`` is only a safety cap on CP-SAT's wall
    time; when it is hit first the plan is still valid but may differ between runs.
    """

    time_limit_s: float = 0.05
    """Wall-clock cap for the whole planner call (the CP-SAT phase gets what is left)."""
    cpsat_deterministic_time: float = 0.005
    """CP-SAT budget per solve in its deterministic time units (reproducible, roughly seconds):
    per neighbourhood of the large-neighbourhood search."""
    num_workers: int = 1
    """CP-SAT search workers (1 keeps the search deterministic and single-core)."""
    seed: int = 0
    """Seed of every randomised part (CP-SAT's random seed, tie-breaking)."""
    sizes: SizeMode = "pow2"
    """Allowed group sizes: powers of two, or any size, in both cases dividing the query heads and
    dividing the key/value heads or a multiple of them (``ModelSpec.allowed_group_sizes``)."""
    max_group_size: int | None = None
    """Largest group size (default: the world size)."""
    group_sizes: tuple[int, ...] | None = None
    """Explicit allowed group sizes; overrides ``sizes`` (each one ``ModelSpec.allowed_group_sizes``
    allows: it divides the query heads, and divides the key/value heads or is a multiple of them)."""
    layout: AttentionLayout = "auto"
    """How groups may split their attention (issue 25, ``planner.layouts``): ``auto`` chooses per
    group among pure Ulysses, the pure ring and one Ulysses x ring layout per size (``u`` the
    largest the heads allow dividing the size and the node, ``r = d/u``; sizes past the heads only
    as rings; a ring needs whole-sample attention, kinds 1d and 3d without joint text attention,
    and samples of ``2r`` tokens or more), ``ulysses`` keeps pure Ulysses (sizes the heads allow),
    ``ring`` makes every group of two or more ranks a pure ring. The default is ``auto``: with
    ``ulysses_candidate`` it is never predicted slower than ``ulysses``, and inside a node a ring
    must beat pure Ulysses by ``in_node_ring_margin``. An executor runs a ring layout only if its
    ``GroupRegistry`` was given it (an epoch declares its layouts,
    ``planner.layouts.config_layouts``, for ``GroupRegistry.from_layouts``; a bounded set,
    ``planner.layouts.num_process_groups``), and the exact CP-SAT model of tiny batches (OPTIMAL
    plans) prices additive costs only, so ring tables get the heuristic and the
    large-neighbourhood search."""
    in_node_ring_margin: float | None = None
    """Inside one node a group runs a ring (``r > 1``) instead of pure Ulysses of its size only
    where the ring is predicted faster by more than this fraction of the Ulysses time (published
    measurements put Ulysses ahead inside a node; a smaller predicted saving is within the cost
    model's own error). None: the cost model's held-out error
    (``planner.layouts.in_node_ring_margin``: the largest held-out MAPE of its compute and ring
    terms), or ``planner.layouts.DEFAULT_IN_NODE_RING_MARGIN`` for a model without one (analytic). Across nodes
    the fastest layout is taken as is."""
    ulysses_candidate: bool = True
    """Under ``layout="auto"``, also plan the batch as ``layout="ulysses"`` does and keep that plan
    where it is faster (each group then at its size's fastest layout), so ``auto`` is never
    predicted slower than ``ulysses`` (``planner.planning``); costs about the time of that second
    search. Off: the layout search alone."""
    ulysses_seeded_min_samples: int | None = 65_536
    """Under ``layout="auto"`` with ``ulysses_candidate``, from this many samples on the layout
    search is not run: the batch is planned as ``layout="ulysses"`` plans it, each group then at
    its size's fastest layout (never slower), with ``auto``'s own baselines (one that is faster
    wins and is polished, as in the search). So ``auto`` costs one search, not two, and is still
    never predicted slower than ``ulysses``. Measured on text-longtail (docs/planner.md): the
    second search doubled the plan's CPU time at 16,384 GPUs x 131,072 samples and found plans
    only 0.03-0.05% faster at 4,096 x 32,768 and 16,384 x 131,072. A batch no pure-Ulysses group
    holds gets the layout search, and so does one where rings may matter: the pure-Ulysses
    problem's lower bound more than ``ulysses_seeded_max_bound_gain`` over the layout problem's.
    None: both searches at every size."""
    ulysses_seeded_max_bound_gain: float = 0.01
    """The most by which the pure-Ulysses problem's lower bound may exceed the layout problem's
    (a fraction of it) for ``ulysses_seeded_min_samples`` to plan from the Ulysses plan: past it,
    rings could save more than that, and the layout search runs (text-longtail at 16,384 x 131,072:
    0.03%; millionctx batches, where ring plans win by far, are well over it)."""
    loss_normalization: LossNormalization = "tokens"
    """Global loss normaliser: total tokens or total samples of the step."""
    use_cpsat: bool = True
    """Run CP-SAT after the heuristic: the exact model on tiny batches, and the
    large-neighbourhood search on larger ones when ``aggregated_cpsat`` is set (off: heuristic
    and baselines only)."""
    aggregated_cpsat: bool = False
    """Run CP-SAT on batches above the exact size: the large-neighbourhood search
    (``planner.search.lns``; the name is the API's option, from the aggregated model it
    replaced). Off in the default 50 ms preset (one round costs 5-30 ms); ``for_budget``
    turns it on from 0.2 s."""
    lns_rounds: int = 16
    """Most neighbourhoods CP-SAT re-solves (sized for 256 samples: proportionally fewer on
    larger batches, at least 1); each gets ``cpsat_deterministic_time``."""
    lns_max_samples: int = 12
    """Most samples freed per neighbourhood (whole micro-batches of the groups chosen)."""
    lns_light_groups: int = 2
    """Least loaded groups in every neighbourhood, besides the slowest and one drawn at random."""
    exact_max_samples: int = 8
    """Batches up to this many samples (and ``exact_max_ranks`` ranks) get the exact per-sample
    CP-SAT model, which proves optimality; larger batches get the large-neighbourhood search."""
    exact_max_ranks: int = 4
    """See ``exact_max_samples``."""
    exact_time_limit_s: float = 5.0
    """Wall-clock cap of the exact model (tiny instances only)."""
    local_search_max_moves: int = 40
    """Most improving moves of the local search per plan."""
    local_search_max_ejections: int = 4
    """Most one-for-many swaps of the local search per plan (``local_search._eject``): when no
    single move or swap lowers the makespan, a sample moves to a larger group that ejects the
    samples it runs least efficiently, lowering the GPU-seconds of both (0: off)."""
    max_resize_tries: int = 0
    """Most split / merge moves of the group-size multiset tried after the local search
    (``planner.search.resize``; each is one re-placement and local search; 0: off). Off in the
    50 ms preset: 3 tries (with 8 ejections) cost 15-21 ms CPU at 256 samples x 32 GPUs for
    0.07-0.22% mean step time, worst step 0.6% (6 steps of video-short, video-balanced and
    text-longtail, baselines off); ``for_budget`` turns them on from 0.2 s."""
    deep_search_min_gap: float = 0.02
    """The ejections and resize moves run only where the heuristic's compute makespan is over
    the compute lower bound by more than this fraction (0: always)."""
    num_candidate_partitions: int = 24
    """Most group-size multisets the heuristic generates."""
    num_lpt_runs: int = 6
    """Most LPT runs (multiset x target makespan) of the heuristic: its main work limit."""
    num_refined: int = 1
    """How many of the best multisets get the target bisection and the local search."""
    num_target_probes: int = 3
    """Bisection steps on the LPT target makespan per refined multiset."""
    bucket_tolerance: float = 0.02
    """Relative work difference up to which consecutive samples (in decreasing work order) are
    placed in bulk by the heuristic's LPT and packing runs, as FlexSP buckets near-equal
    sequences; costs, the local search and the final plan stay exact per sample (0: bulk
    placement of identical samples only)."""
    lp_bound_iterations: int = 4
    """Bisection steps of the partition LP bound (``planner.bounds.lp``), run after the search
    when the gap to the other bounds is over ``lp_bound_min_gap`` (0: never). It only changes
    the reported bound, never the plan; each step is one LP solve (5-20 ms for 256 samples).
    On in every preset: 4 steps over at most ``lp_bound_max_classes`` merged sample classes by
    default (the 50 ms preset), 5 and more from 0.2 s over every class. Sized for 256
    samples: larger batches get proportionally fewer steps (at least 1)."""
    lp_bound_max_classes: int | None = 64
    """Above this many sample classes the partition LP runs on the classes merged into this many
    buckets counted in work units (``planner.bounds.lp_merge``: still a relaxation; None: never
    merged). A work limit: an LP solve's cost grows with the classes (about 5 ms at 20 classes,
    20 ms at 250 on the 2-core development machine). On 5 steps of text-longtail @ gpt-oss-120b,
    256 samples on h200x64 (EP 8), 4 steps over 64 buckets gave the bound of 5 over all 256
    classes, for 55-90 ms CPU a step against 150-300 ms (load 6-7); with it the default preset's
    mean gap to its own bound there fell from 7.37% (the simple bounds) to 2.87%
    (``bench/results/plan_quality_moe.json``), for about 75-100 ms more CPU a step."""
    lp_bound_rel_tol: float = 0.005
    """Each bisection of the partition LP bound stops once its bracket is within this fraction
    of its top (``planner.bounds.bisect.threshold``; 0: all ``lp_bound_iterations`` steps). A work
    limit of the 50 ms preset: on 2 steps each of video-long 32 x 256 and video-short 32 x 64
    it cut the LP's solves from 7 to 4 and its CPU by about 40% (15-20 ms), for a bound 0.05-0.2%
    of the step time lower (at most 0.28% of mean gap over 3 steps of the 64-1,024-sample cells;
    none where the bisection stops on its own first); ``for_budget`` sets 0 from 0.2 s."""
    lp_bound_integral: bool = False
    """Whole group counts in the partition LP bound (a small MIP: tighter, about twice the
    time; ``for_budget`` turns it on from 0.5 s); batches of over 64 sample classes get the
    plain LP."""
    lp_bound_min_gap: float = 0.02
    """Relative gap above which the partition LP bound is computed (a plan within it of the
    simple bounds is left with them)."""
    lp_bound_micro_batch_buckets: int = 1
    """``M`` of the partition LP (``planner.bounds.lp``): groups at 1 .. ``M - 1`` micro-batches
    and at least ``M``; above 1, a second bisection on that finer problem follows the
    one-bucket LP's. Worth it with whole groups only: ``for_budget`` sets 2 from 0.5 s (with
    ``lp_bound_integral``), where on 8 steps of video-short 32 x 256 it cut the 1 s preset's
    mean / p95 gap from 1.86% / 3.85% to 1.26% / 2.95% for ~0.1 s CPU; as a plain LP it costs
    2-3x per solve at 250 classes for little (the offline benchmark takes the module's 3)."""
    pattern_bound_iterations: int = 5
    """Bisection steps of the pattern bound (``planner.bounds.patterns``: a configuration LP over
    the groups a plan can have, a sample never split between groups), run after the search on
    batches of at most ``pattern_bound_max_samples`` samples when the gap is over
    ``pattern_bound_min_gap`` (0: never). It only changes the reported bound, never the plan.
    On 16 Wan2.1-1.3B clips at h200x64 it took the bound from 2-12% to 0.2-3% under the plans
    for 0.05-0.07 s CPU a step. The cover search and this bound share the table's enumerations
    (``planner.bounds.patterns.PatternMemo``); with ``cover_search`` and ``cover_min_gap`` the 50 ms
    preset took 0.05-0.42 s CPU a plan on 16-32 samples where each enumeration was repeated
    (0.31-1.14 s; 3 steps each of five cells, p50, load 9-11 on 2 cores)."""
    cover_search: bool = True
    """On batches of at most ``pattern_bound_max_samples`` samples, also plan from a whole cover
    of maximal patterns at the least deadline found (``planner.search.cover``), kept where
    faster than the search's plan."""
    cover_min_gap: float = 0.01
    """The cover search runs only where the plan's step time is over the simple bounds by more
    than this fraction, and tries whole covers only where it is over the pattern threshold (the
    pattern bound on the table's own times, computed first and shared with the reported bound) by
    more than it: a plan within it of either gains at most that much from a cover (0: always).
    ``for_budget`` sets 0 from 0.2 s."""
    pattern_bound_max_samples: int = 32
    """The pattern bound runs on batches of at most this many samples (its patterns multiply
    with the distinct lengths a group holds; on larger batches the other bounds are as tight)."""
    pattern_max_visits: int = 20_000
    """Search nodes of one pattern enumeration (one deadline) at most, for the pattern bound and
    the cover search: their work limit (past it they keep what they proved, or give up)."""
    pattern_bound_min_gap: float = 0.01
    """Relative gap above which the pattern bound is computed."""
    strict_bounds: bool = True
    """A lower bound above the plan's own step time (a bug) raises ``BoundError``. False (the
    service's jobs and plan requests, ``planner.epoch.plan_samples``): the bound is dropped, the
    next valid one reported, the error logged with the batch's digest and its kind returned in
    ``SearchStats.dropped_bounds`` (the service counts them in a metric)."""
    compute_baselines: bool = True
    """Compute the baselines (needed for the never-slower-than-a-baseline guarantee)."""
    polish_baseline: bool = True
    """When a baseline's plan beats the search's, seed the local search with its groups (and
    lay it out with ``intra_policies``); the result, if faster than the baseline, is returned
    with method ``<baseline>+search`` and status ``HEURISTIC`` (off: the baseline as is)."""
    baseline_group_size: int | None = None
    """One more fixed SP size for the bucket baseline (``bucket-sp{d}``), besides 1, 2, 4, 8."""
    intra_policies: bool = True
    """DCP-intra: choose checkpoint policies per micro-batch jointly with the micro-batch split
    (``planner.search.intra``; samples of a micro-batch share the memory, so activations are
    kept where they save most recompute per byte, and a micro-batch fewer can pay for some
    recompute). Off: every sample at its cheapest policy alone (``k_min``), packed first-fit
    (the "inter only" ablation of ``bench/plan_quality.py``)."""
    intra_search: bool = False
    """Price groups with the per-micro-batch policies during the local search too (not only
    when the final draft is laid out); needs ``intra_policies``. Off in every preset: it took
    2-4x the search time for +0.03% step time (3 steps per workload at 8 and 32 GPUs)."""
    memory_safety_fraction: float = 0.05
    """Share of the activation budget (memory cap minus model states and fixed buffers) kept
    free as a margin against activation-memory error of the cost model: plans use at most
    ``(1 - fraction)`` of it, so activations up to ``1 / (1 - fraction) - 1`` (5.3% at the
    default 0.05) above the model's figure still fit. The default matches the cost model's 5%
    memory target (issue 9); with a fitted memory term of known error, set it at least that
    large (``bench/model_sensitivity.py``: activations 30% over the model put 94 of 100
    margin-less plans over the cap). 0 plans right up to the cap."""

    @classmethod
    def for_budget(cls, time_limit_s: float, **overrides: object) -> PlannerConfig:
        """A config whose work limits suit a latency budget (quality grows with the budget).

        The limits are work counts and CP-SAT deterministic time, so the plan stays
        reproducible; they were sized on one core for 256 samples at 32 GPUs
        (``bench/plan_quality.py``, budgets table). The CP-SAT large-neighbourhood search runs
        from 0.5 s.
        """
        if time_limit_s < 0.1:
            # The defaults (the partition LP over at most 64 merged classes included).
            work: dict[str, object] = {}
        elif time_limit_s < 0.5:
            work = dict(num_lpt_runs=16, num_refined=2, local_search_max_moves=200,
                        num_target_probes=6, aggregated_cpsat=False, lp_bound_iterations=5,
                        lp_bound_max_classes=None, lp_bound_min_gap=0.01, lp_bound_rel_tol=0.0,
                        cover_min_gap=0.0, max_resize_tries=8, local_search_max_ejections=8)
        else:
            # CP-SAT's deterministic time is ~5-12 s of wall time per unit on the 2-core
            # development machine: 16 neighbourhoods at 0.005 take ~0.4-0.8 s.
            work = dict(num_lpt_runs=48, num_refined=3, local_search_max_moves=600,
                        num_target_probes=8, aggregated_cpsat=True, lns_rounds=16,
                        cpsat_deterministic_time=0.005, lp_bound_iterations=8,
                        lp_bound_max_classes=None, lp_bound_min_gap=0.01, lp_bound_rel_tol=0.0,
                        cover_min_gap=0.0, lp_bound_integral=True, lp_bound_micro_batch_buckets=2,
                        max_resize_tries=16, deep_search_min_gap=0.01,
                        local_search_max_ejections=8)
        work.update(overrides)
        return cls(time_limit_s=time_limit_s, **work)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be positive, got {self.time_limit_s}")
        if not self.cpsat_deterministic_time > 0:
            raise ValueError(
                f"cpsat_deterministic_time must be positive, got {self.cpsat_deterministic_time}")
        if self.in_node_ring_margin is not None and not 0 <= self.in_node_ring_margin < 1:
            raise ValueError(f"in_node_ring_margin must be in [0, 1), got {self.in_node_ring_margin}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {self.num_workers}")
        if self.sizes not in ("pow2", "any"):
            raise ValueError(f"sizes must be 'pow2' or 'any', got {self.sizes!r}")
        if self.layout not in ("auto", "ulysses", "ring"):
            raise ValueError(f"layout must be 'auto', 'ulysses' or 'ring', got {self.layout!r}")
        if self.max_group_size is not None and self.max_group_size < 1:
            raise ValueError(f"max_group_size must be at least 1, got {self.max_group_size}")
        if self.group_sizes is not None and (not self.group_sizes or any(d < 1 for d in self.group_sizes)):
            raise ValueError(f"group_sizes must be positive integers, got {self.group_sizes}")
        if self.loss_normalization not in ("tokens", "samples"):
            raise ValueError(
                f"loss_normalization must be 'tokens' or 'samples', got {self.loss_normalization!r}")
        if not self.deep_search_min_gap >= 0:
            raise ValueError(
                f"deep_search_min_gap must be non-negative, got {self.deep_search_min_gap}")
        if not self.cover_min_gap >= 0:
            raise ValueError(f"cover_min_gap must be non-negative, got {self.cover_min_gap}")
        if not 0 <= self.lp_bound_rel_tol < 1:
            raise ValueError(f"lp_bound_rel_tol must be in [0, 1), got {self.lp_bound_rel_tol}")
        if not self.lp_bound_min_gap >= 0:
            raise ValueError(f"lp_bound_min_gap must be non-negative, got {self.lp_bound_min_gap}")
        for name in ("exact_max_samples", "exact_max_ranks", "local_search_max_moves",
                     "local_search_max_ejections", "max_resize_tries",
                     "num_target_probes", "lp_bound_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.lp_bound_max_classes is not None and self.lp_bound_max_classes < 1:
            raise ValueError(f"lp_bound_max_classes must be at least 1, got {self.lp_bound_max_classes}")
        if self.lp_bound_micro_batch_buckets < 1:
            raise ValueError("lp_bound_micro_batch_buckets must be at least 1, got "
                             f"{self.lp_bound_micro_batch_buckets}")
        if self.num_lpt_runs < 1 or self.num_refined < 1:
            raise ValueError(f"num_lpt_runs and num_refined must be at least 1, got "
                             f"{self.num_lpt_runs} and {self.num_refined}")
        if self.num_candidate_partitions < 1:
            raise ValueError(
                f"num_candidate_partitions must be at least 1, got {self.num_candidate_partitions}")
        if not 0 <= self.bucket_tolerance < 1:
            raise ValueError(f"bucket_tolerance must be in [0, 1), got {self.bucket_tolerance}")
        if not self.exact_time_limit_s > 0:
            raise ValueError(f"exact_time_limit_s must be positive, got {self.exact_time_limit_s}")
        if self.baseline_group_size is not None and self.baseline_group_size < 1:
            raise ValueError(
                f"baseline_group_size must be at least 1, got {self.baseline_group_size}")
        if not 0 <= self.memory_safety_fraction < 0.5:
            raise ValueError(
                f"memory_safety_fraction must be in [0, 0.5), got {self.memory_safety_fraction}")
