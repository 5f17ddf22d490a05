"""plan_batch on the shipped presets: validity, baselines, determinism, fallback, bad input."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from planner.config import PlannerConfig
from planner.planning import plan_batch, plan_batch_with_stats
from planner.validate import simulate, validate_plan
from planner.workload import WorkloadSpec, sample_batch
from tests.planner.tiny import samples_of, tiny_cluster, tiny_cost_model

WORKLOADS = ["video-short", "video-balanced", "video-long", "text-longtail", "text-longcontext"]


def _setup(workload: str, cluster_name: str):  # type: ignore[no-untyped-def]
    spec = WorkloadSpec.preset(workload)
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    return spec, cluster, cmf, CostModel(file=cmf, cluster=cluster)


# (cluster, workload) cells of the 96-sample preset batch below where a baseline's plan beats
# the planner's own search, measured: at h200x8 static-best (eight single-rank groups, LPT) beats
# the heuristic on video-balanced; the plan returned there is static-best's groups polished by
# the local search and the intra-step policies (method 'static-best+search'). Under the analytic
# default's published kernel-efficiency curves the heuristic's own plan wins video-long; with the
# bytes LlamaDecoderLayer really keeps (costmodel/presets/activation_bytes.json) it also wins
# text-longcontext at h200x32, where static-best's seed won before.
BASELINE_WINS = {("h200x8", "video-balanced")}


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("cluster_name", ["h200x8", "h200x32"])
def test_preset_plans_are_valid_and_found_by_the_planner(workload: str, cluster_name: str
                                                        ) -> None:
    spec, cluster, cmf, cm = _setup(workload, cluster_name)
    samples = sample_batch(spec, num_samples=96, seed=5, step=2)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, step=2,
                      reference_sample=spec.max_sample)
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert plan.step == 2
    assert {"bucket-sp4", "static-best", "megatron-dyncp", "dcp-greedy"} <= set(plan.baselines_s)
    assert 0 < plan.lower_bound.value_s <= plan.predicted_step_time_s  # no clamp: a real check
    report = simulate(plan, cm)
    assert report.step_time_s == pytest.approx(plan.predicted_step_time_s, rel=1e-9)
    assert 0.0 <= report.idle_fraction < 1.0
    assert len(report.peak_mem_bytes_per_rank) == cluster.num_gpus
    assert max(report.peak_mem_bytes_per_rank) <= cluster.memory_cap_bytes
    assert plan.solver.status != "BASELINE", (plan.solver.method, plan.baselines_s)
    seeded = plan.solver.method.endswith("+search")
    assert seeded == ((cluster_name, workload) in BASELINE_WINS), plan.solver.method
    # The status says where the plan came from: a polished baseline is not the search's result.
    assert (plan.solver.status == "POLISHED_BASELINE") == seeded, plan.solver


_shapes = st.one_of(
    st.integers(min_value=64, max_value=200_000).map(lambda t: {"tokens": t}),
    st.tuples(st.integers(1, 120), st.integers(4, 45), st.integers(4, 80)).map(
        lambda fhw: {"frames": fhw[0], "height": fhw[1], "width": fhw[2]}),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(_shapes, min_size=1, max_size=40),
       cluster_name=st.sampled_from(["h200x8", "h200x32", "h100x16"]),
       sizes=st.sampled_from(["pow2", "any"]),
       normalization=st.sampled_from(["tokens", "samples"]))
def test_every_plan_passes_the_validator(shapes: list[dict[str, int]], cluster_name: str,
                                         sizes: str, normalization: str) -> None:
    is_2d = [("frames" in s) for s in shapes]
    model = "stdit3-xl" if sum(is_2d) * 2 >= len(shapes) else "llama-7b"
    samples = [Sample(id=f"h{i}", **shape) for i, shape in enumerate(shapes)]
    if model == "stdit3-xl":  # a 2D model takes 2D samples only (a 1D one is refused, named)
        samples = [s for s in samples if s.is_2d]
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(model, cluster.hardware.name)
    cm = CostModel(file=cmf, cluster=cluster)
    config = PlannerConfig(sizes=sizes, loss_normalization=normalization)  # type: ignore[arg-type]
    try:
        plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config)
    except ValueError as exc:  # only a sample too large for the largest group may be refused
        assert "fits nowhere" in str(exc)
        return
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert sorted(plan.sample_ids) == sorted(s.id for s in samples)


@settings(max_examples=25, deadline=None)
@given(tokens=st.lists(st.integers(20, 2600), min_size=1, max_size=6),
       num_gpus=st.sampled_from([2, 4]))
def test_tiny_plans_with_the_exact_model_are_valid(tokens: list[int], num_gpus: int) -> None:
    cluster = tiny_cluster(num_gpus=num_gpus, gpus_per_node=2)
    cmf = tiny_cost_model()
    samples = samples_of(tokens)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(exact_max_ranks=4))
    assert validate_plan(plan, samples, cost_model=CostModel(file=cmf, cluster=cluster)) == []
    assert sorted(plan.sample_ids) == sorted(s.id for s in samples)


@pytest.mark.parametrize(("workload", "config"), [
    ("video-short", PlannerConfig()),
    ("text-longtail", PlannerConfig.for_budget(0.2)),
])
def test_same_input_and_seed_give_the_same_plan(workload: str, config: PlannerConfig) -> None:
    spec, cluster, cmf, _ = _setup(workload, "h200x32")
    samples = sample_batch(spec, num_samples=128, seed=3, step=7)
    first = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config, step=7)
    second = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config, step=7)
    assert first.content_json() == second.content_json()
    assert first.content_digest() == second.content_digest()


def test_exact_model_is_deterministic() -> None:
    cluster = tiny_cluster(num_gpus=4, gpus_per_node=2)
    cmf = tiny_cost_model()
    samples = samples_of([1500, 700, 300, 90, 60])
    config = PlannerConfig(exact_max_ranks=4, seed=11)
    plans = [plan_batch(samples, cluster=cluster, cost_model=cmf, config=config) for _ in range(2)]
    assert plans[0].content_json() == plans[1].content_json()
    assert plans[0].solver.seed == 11


def test_tiny_time_limit_falls_back_to_a_valid_plan() -> None:
    cluster = tiny_cluster(num_gpus=4, gpus_per_node=2)
    cmf = tiny_cost_model()
    samples = samples_of([2400, 1300, 800, 500, 120, 90, 60, 40])
    config = PlannerConfig(exact_max_ranks=4, exact_time_limit_s=1e-4, time_limit_s=1e-4)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config)
    assert validate_plan(plan, samples, cost_model=CostModel(file=cmf, cluster=cluster)) == []
    assert plan.solver.status != "OPTIMAL"  # no proof in 0.1 ms


def test_lns_under_a_tiny_limit_keeps_a_valid_plan() -> None:
    spec, cluster, cmf, cm = _setup("video-balanced", "h200x32")
    samples = sample_batch(spec, num_samples=200, seed=1, step=0)
    config = PlannerConfig(aggregated_cpsat=True, time_limit_s=1e-4, cpsat_deterministic_time=1e-4)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config)
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert plan.solver.status in ("HEURISTIC", "BASELINE", "FEASIBLE")


def test_a_1d_sample_for_a_2d_model_is_named() -> None:
    cluster = load_cluster("h200x8")
    cmf = default_cost_model_file("stdit3-xl", cluster.hardware.name)
    samples = [Sample(id="clip", tokens=4096, frames=4, height=32, width=32), Sample(id="flat", tokens=4096)]
    with pytest.raises(ValueError, match="'flat'.*2D"):
        plan_batch(samples, cluster=cluster, cost_model=cmf)


def test_empty_batch_is_an_error() -> None:
    _, cluster, cmf, _ = _setup("text-longtail", "h200x8")
    with pytest.raises(ValueError, match="empty"):
        plan_batch([], cluster=cluster, cost_model=cmf)


def test_a_sample_that_fits_nowhere_is_named() -> None:
    _, cluster, cmf, _ = _setup("text-longtail", "h200x8")
    samples = [Sample(id="ok", tokens=4096), Sample(id="monster", tokens=50_000_000)]
    with pytest.raises(ValueError, match=r"'monster' \(50,000,000 tokens\) fits nowhere.*"
                       r"needs \d+\.?\d* [GT]iB of activations.*limit of \d+\.?\d* GiB"):
        plan_batch(samples, cluster=cluster, cost_model=cmf)


def test_a_world_the_sizes_cannot_partition_is_an_error() -> None:
    cluster = tiny_cluster(num_gpus=6, gpus_per_node=6)
    cmf = tiny_cost_model()
    with pytest.raises(ValueError, match=r"world of 6 ranks cannot be partitioned.*\[4\]"):
        plan_batch(samples_of([100, 200]), cluster=cluster, cost_model=cmf,
                   config=PlannerConfig(group_sizes=(4,)))


def test_a_size_the_heads_do_not_allow_is_an_error() -> None:
    cluster = tiny_cluster(num_gpus=6, gpus_per_node=6)
    with pytest.raises(ValueError, match="group size 3 is not allowed"):
        plan_batch(samples_of([100]), cluster=cluster, cost_model=tiny_cost_model(num_heads=4),
                   config=PlannerConfig(group_sizes=(1, 3), layout="ulysses"))  # auto: 3 as a ring


def test_repeated_sample_ids_are_an_error() -> None:
    _, cluster, cmf, _ = _setup("text-longtail", "h200x8")
    with pytest.raises(ValueError, match="'a' appears more than once"):
        plan_batch([Sample(id="a", tokens=10), Sample(id="a", tokens=20)], cluster=cluster,
                   cost_model=cmf)


def test_non_power_of_two_sizes_are_used_when_allowed() -> None:
    cluster = tiny_cluster(num_gpus=6, gpus_per_node=6)
    cmf = tiny_cost_model(num_heads=6)
    samples = samples_of([2600, 2500, 120, 80])
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(sizes="any", use_cpsat=False))
    cm = CostModel(file=cmf, cluster=cluster)
    assert validate_plan(plan, samples, cost_model=cm) == []
    pow2 = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(sizes="pow2", use_cpsat=False))
    assert all(g.size & (g.size - 1) == 0 for g in pow2.groups)
    assert plan.predicted_step_time_s <= pow2.predicted_step_time_s * (1 + 1e-9)


@pytest.mark.parametrize(("field", "value"), [
    ("time_limit_s", 0.0), ("num_workers", 0), ("sizes", "odd"), ("max_group_size", 0),
    ("group_sizes", ()), ("loss_normalization", "bytes"), ("num_lpt_runs", 0),
    ("memory_safety_fraction", 0.7), ("bucket_tolerance", -0.1), ("bucket_tolerance", 1.0),
    ("lp_bound_iterations", -1), ("lp_bound_min_gap", -0.5), ("lp_bound_micro_batch_buckets", 0),
])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PlannerConfig(**{field: value})  # type: ignore[arg-type]


def test_lns_plan_is_valid_and_claims_no_bound() -> None:
    spec, cluster, cmf, cm = _setup("video-short", "h200x32")
    samples = sample_batch(spec, num_samples=160, seed=9, step=3)
    plan, stats = plan_batch_with_stats(
        samples, cluster=cluster, cost_model=cmf,
        config=PlannerConfig(aggregated_cpsat=True, time_limit_s=5.0, lns_rounds=3,
                             cpsat_deterministic_time=0.01))
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert stats.lns_rounds == 3
    assert plan.solver.objective_bound_s is None  # the neighbourhoods prove nothing global
    assert plan.lower_bound.value_s <= plan.predicted_step_time_s


def test_a_bound_above_a_valid_plan_is_refused_loudly(caplog: pytest.LogCaptureFixture) -> None:
    from planner.planning import BoundError, check_bound

    check_bound(2.0, "cpsat-optimal", 2.0, status="OPTIMAL")  # equal, with CP-SAT's proof: fine
    check_bound(2.0 * (1 + 1e-12), "area", 2.0, status="OPTIMAL")  # summation-order noise is fine
    check_bound(2.0 * (1 - 1e-8), "area", 2.0, status="HEURISTIC")  # below, beyond the noise: fine
    with caplog.at_level("ERROR", logger="planner.bounds.check"), \
            pytest.raises(BoundError, match=r"'largest-choice' = 2\.1 s exceeds the step time 2 s"):
        check_bound(2.1, "largest-choice", 2.0, status="OPTIMAL")
    assert "the bound is wrong" in caplog.text


@pytest.mark.parametrize("status", ["HEURISTIC", "FEASIBLE", "BASELINE", "POLISHED_BASELINE"])
def test_a_bound_equal_to_a_plan_nothing_proved_optimal_is_refused(status: str) -> None:
    """Two-sided: a bound that reaches the step time of a plan no solver proved optimal claims an
    optimality nobody showed (a bound set to the plan's own time, a broken LP bisection)."""
    from planner.planning import BoundError, check_bound

    for bound_s in (2.0, 2.0 * (1 - 1e-10), 2.0 * (1 + 1e-10)):
        with pytest.raises(BoundError, match=f"equals the step time 2 s of a {status} plan"):
            check_bound(bound_s, "partition-lp", 2.0, status=status)
    with pytest.raises(BoundError, match=f"'cpsat-optimal' on a {status} plan"):
        check_bound(1.5, "cpsat-optimal", 2.0, status=status)
    with pytest.raises(BoundError, match="exceeds"):
        check_bound(float("nan"), "area", 2.0, status=status)


@pytest.mark.parametrize(("workload", "cluster_name", "num_samples"), [
    ("video-balanced", "h200x8", 64), ("text-longtail", "h200x32", 128),
    ("video-long", "h200x32", 96), ("video-short", "h200x32", 256),
])
def test_bounds_stay_below_the_best_plan_found_with_a_long_budget(
        workload: str, cluster_name: str, num_samples: int) -> None:
    spec, cluster, cmf, cm = _setup(workload, cluster_name)
    samples = sample_batch(spec, num_samples=num_samples, seed=8, step=0)
    quick = plan_batch(samples, cluster=cluster, cost_model=cmf, reference_sample=spec.max_sample,
                       config=PlannerConfig(lp_bound_iterations=8, lp_bound_min_gap=0.0))
    long = plan_batch(samples, cluster=cluster, cost_model=cmf, reference_sample=spec.max_sample,
                      config=PlannerConfig.for_budget(2.0, lp_bound_min_gap=0.0))
    best_s = min(quick.predicted_step_time_s, long.predicted_step_time_s)
    for plan in (quick, long):
        assert validate_plan(plan, samples, cost_model=cm) == []
        assert plan.lower_bound.value_s <= best_s * (1 + 1e-9), plan.lower_bound
        if plan.solver.objective_bound_s is not None:
            assert plan.solver.objective_bound_s <= best_s * (1 + 1e-9)
    # The offline partition MIP (whole groups, the module's micro-batch buckets) too.
    from planner.bounds.lp import partition_lp_bound
    from planner.planning import prepare

    prep = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig())
    sync = prep.table.grad_sync_s
    lp = partition_lp_bound(prep.table, lower_s=prep.bounds.compute_makespan_s, iterations=10,
                            integral_groups=True)
    assert lp + sync <= best_s * (1 + 1e-9)


def test_for_budget_scales_the_work_limits() -> None:
    small, medium, large = (PlannerConfig.for_budget(b) for b in (0.05, 0.2, 1.0))
    assert small.num_lpt_runs < medium.num_lpt_runs < large.num_lpt_runs
    assert not small.aggregated_cpsat and not medium.aggregated_cpsat and large.aggregated_cpsat
    assert large.time_limit_s == 1.0
    assert PlannerConfig.for_budget(0.2, seed=4).seed == 4


@pytest.mark.parametrize("sizes", ["pow2", "any"])
def test_a_24_gpu_world_with_24_heads(sizes: str) -> None:
    from costmodel.analytic import analytic_cost_model
    from costmodel.presets import load_hardware
    from costmodel.specs import ClusterSpec, ModelSpec

    model = ModelSpec(name="heads24", kind="1d", num_layers=24, hidden=3072, num_heads=24,
                      ffn_hidden=8192, vocab=32000)
    hardware = load_hardware("h200-sxm")
    cmf = analytic_cost_model(model, hardware)
    cluster = ClusterSpec(name="h200x24", hardware=hardware, num_gpus=24, gpus_per_node=8)
    spec = WorkloadSpec.preset("text-longtail")
    samples = sample_batch(spec, num_samples=120, seed=2, step=1)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(sizes=sizes))  # type: ignore[arg-type]
    cm = CostModel(file=cmf, cluster=cluster)
    assert validate_plan(plan, samples, cost_model=cm) == []
    assert sum(g.size for g in plan.groups) == 24
    if sizes == "pow2":
        assert all(g.size & (g.size - 1) == 0 for g in plan.groups)


@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.1])
def test_bucket_runs_hold_near_equal_samples_only(tolerance: float) -> None:
    from planner.planning import prepare
    from planner.search.heuristic import _order, bucket_runs

    spec, cluster, cmf, _ = _setup("text-longtail", "h200x32")
    samples = sample_batch(spec, num_samples=256, seed=0, step=1)
    table = prepare(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig()).table
    order = _order(table)
    ends = bucket_runs(table, order, tolerance=tolerance)
    assert ends[-1] == len(order) and ends == sorted(set(ends))
    sizes = [float(d) for d in table.sizes]
    cls = table.classes.class_of
    work = [min(table.time_s[c, j] * sizes[j] for j in range(len(sizes)))
            for c in range(table.classes.num_classes)]
    start = 0
    for end in ends:
        run = [cls[i] for i in order[start:end]]
        if tolerance == 0:
            assert len(set(run)) == 1
        for c in run:
            assert work[c] >= work[run[0]] * (1 - tolerance)
            assert list(table.time_s[c] < float("inf")) == list(table.time_s[run[0]] < float("inf"))
        start = end
    if tolerance > 0:  # distinct lengths: bucketing must merge some of them
        assert len(ends) < table.classes.num_classes


@pytest.mark.parametrize("workload", ["text-longtail", "video-balanced"])
def test_bucketed_search_keeps_exact_per_sample_plans(workload: str) -> None:
    spec, cluster, cmf, cm = _setup(workload, "h200x32")
    samples = sample_batch(spec, num_samples=200, seed=1, step=4)
    for tolerance in (0.0, 0.05):
        config = PlannerConfig(bucket_tolerance=tolerance)
        plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config,
                          reference_sample=spec.max_sample)
        assert validate_plan(plan, samples, cost_model=cm) == []
        assert simulate(plan, cm).step_time_s == pytest.approx(plan.predicted_step_time_s,
                                                               rel=1e-9)
        assert sorted(plan.sample_ids) == sorted(s.id for s in samples)
        by_id = {s.id: s for s in samples}
        for g in plan.groups:  # each sample unchanged and costed exactly on its group
            for mb in g.micro_batches:
                for ps in mb.samples:
                    assert ps.sample == by_id[ps.sample.id]
                    assert ps.predicted_time_s == pytest.approx(float(cm.sample_time_s(
                        ps.sample.tokens, group_size=g.size, recompute_layers=ps.recompute_layers,
                        frames=ps.sample.num_frames, spatial=ps.sample.spatial_tokens)), rel=1e-9)
        again = plan_batch(samples, cluster=cluster, cost_model=cmf, config=config,
                           reference_sample=spec.max_sample)
        assert again.content_digest() == plan.content_digest()


def test_gqa_plans_use_groups_past_the_kv_heads_for_long_samples() -> None:
    """Llama-3.1-8B (32 query heads, 8 KV heads) on 128k-token samples: groups of 16 and 32 (past
    the KV heads, each rank a replicated KV head) are allowed, used, priced and valid."""
    from costmodel.presets import load_model

    model = load_model("llama-3.1-8b")
    assert model.allowed_group_sizes(max_size=64) == [1, 2, 4, 8, 16, 32]
    cluster = load_cluster("h200x64")
    cmf = default_cost_model_file("llama-3.1-8b", "h200-sxm")
    cm = CostModel(file=cmf, cluster=cluster)
    samples = [Sample(id=f"long{i}", tokens=131072) for i in range(4)] + [
        Sample(id=f"short{i}", tokens=2048) for i in range(120)]
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(use_cpsat=False))
    assert validate_plan(plan, samples, cost_model=cm) == []
    long_groups = {g.size for g in plan.groups for mb in g.micro_batches for ps in mb.samples
                   if ps.sample.id.startswith("long")}
    assert long_groups & {16, 32}, long_groups  # past the 8 KV heads
    # Limited to the KV heads (the old rule), the same batch is slower.
    capped = plan_batch(samples, cluster=cluster, cost_model=cmf,
                        config=PlannerConfig(use_cpsat=False, max_group_size=8))
    assert plan.predicted_step_time_s < capped.predicted_step_time_s


def test_group_sizes_follow_the_gqa_rule_and_the_error_says_it() -> None:
    """24 query heads, 8 KV heads: 24 (three ranks a KV head) is allowed, 12 and 6 (neither a
    divisor nor a multiple of 8) are not, and an explicit 12 is refused naming the rule."""
    from costmodel.analytic import analytic_cost_model
    from costmodel.presets import load_hardware
    from costmodel.specs import ModelSpec

    model = ModelSpec(name="gqa-24-8", kind="1d", num_layers=4, hidden=24 * 64, num_heads=24, num_kv_heads=8,
                      ffn_hidden=4096, vocab=32000)
    assert model.allowed_group_sizes(max_size=64) == [1, 2, 4, 8, 24]
    cmf = analytic_cost_model(model, load_hardware("h200-sxm"))
    cluster = load_cluster("h200x64")
    samples = [Sample(id=f"s{i}", tokens=4096 * (1 + i % 4)) for i in range(64)]
    with pytest.raises(ValueError, match=r"group size 12 is not allowed: it must divide num_heads=24, "
                                         r"divide kv_heads=8 or be a multiple of it.*allowed: \[1, 2, 4, 8, 24\]"):
        plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(group_sizes=(12,), layout="ulysses"))
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(sizes="any", use_cpsat=False, layout="ulysses"))
    assert {g.size for g in plan.groups} <= {1, 2, 4, 8, 24}
    assert validate_plan(plan, samples, cost_model=CostModel(file=cmf, cluster=cluster)) == []
