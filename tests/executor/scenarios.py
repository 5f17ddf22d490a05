"""The plans of the multi-process tests (world of 4), and the code every rank runs.

Run under ``torch.multiprocessing.spawn``; each rank saves what it computed to
``<out_dir>/rank<r>.pt`` and the test process compares against single-process references.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from executor.consistency import PlanMismatchError
from executor.groups import GroupRegistry
from executor.runtime import Executor
from planner.plan import Plan
from tests.executor import sync_scenarios
from tests.executor.helpers import (
    CONFIG,
    build_model,
    dataset_for,
    gloo_rank,
    make_plan,
    s1d,
    s2d,
)

WORLD = 4
L = CONFIG.num_layers
GQA_CASES = [("1d", 2, 0), ("1d", 2, 1), ("1d", 2, 2), ("1d", 1, 1), ("3d", 2, 0), ("3d", 2, 1), ("3d", 1, 1)]
"""(kind, key/value heads, plan index) run with grouped-query self-attention (``CONFIG.num_heads`` = 4
query heads): groups of 4 are past 2 key/value heads, groups of 2 and 4 past 1."""
JOINT_CASES = [(4, 0), (4, 1), (2, 1), (1, 0)]
"""(key/value heads, video plan index) run by the 3D model with joint text attention (``3d_joint``:
``executor.joint.JointDiT3D``): multi-head, then past 2 and 1 key/value heads."""


def plans_1d() -> list[Plan]:
    """Mixed groups 2+1+1 then one group of 4; uneven lengths, mixed policies per micro-batch."""
    a = make_plan([
        ([0, 1], [[(s1d("a", 7), 0), (s1d("b", 9), L)], [(s1d("c", 5), 1)]]),
        ([2], [[(s1d("d", 6), 2), (s1d("e", 3), 0)]]),
        ([3], [[(s1d("f", 8), L)], [(s1d("g", 4), 0), (s1d("h", 2), 1)]]),
    ], num_ranks=WORLD, step=0)
    b = make_plan([
        ([0, 1, 2, 3], [[(s1d("i", 11), 1), (s1d("j", 3), 0), (s1d("k", 6), L)],
                        [(s1d("l", 13), 0)], [(s1d("m", 2), 2)]]),
    ], num_ranks=WORLD, step=1)
    c = make_plan([
        ([0], [[(s1d("n", 5), 0)]]),
        ([1, 2], [[(s1d("o", 10), 2), (s1d("p", 1), 0)]]),
        ([3], []),
    ], num_ranks=WORLD, step=2, normalizer="samples")
    return [a, b, c]


def plans_2d() -> list[Plan]:
    """Mixed groups 2+1+1 then 4; frames x height x width not divisible by the group size."""
    a = make_plan([
        ([0, 1], [[(s2d("A", 3, 1, 3), 0), (s2d("B", 2, 2, 2), L)], [(s2d("C", 1, 3, 3), 1)]]),
        ([2], [[(s2d("D", 2, 1, 2), 2)], [(s2d("E", 4, 1, 1), 0)]]),
        ([3], [[(s2d("F", 3, 2, 1), L), (s2d("G", 1, 1, 2), 0)]]),
    ], num_ranks=WORLD, step=0)
    b = make_plan([
        ([0, 1, 2, 3], [[(s2d("H", 3, 1, 5), 1), (s2d("I", 1, 1, 3), L)],
                        [(s2d("J", 2, 3, 1), 0), (s2d("K", 5, 1, 1), 2)]]),
    ], num_ranks=WORLD, step=1)
    return [a, b]


def gqa_plan(kind: str, index: int) -> Plan:
    """Plan ``index`` of the kind's scenario plans (the 3D model runs the video plans)."""
    return (plans_1d() if kind == "1d" else plans_2d())[index]


def planned_gqa_plan() -> Plan:
    """A plan the planner makes (not by hand) for the 1D model with one key/value head on a
    ``cpu:4`` cluster whose memory holds the 40-token sample only on a group of 2 or more (even
    fully checkpointed): its group is past the key/value head."""
    from costmodel.analytic import analytic_cost_model
    from costmodel.evaluate import CostModel
    from costmodel.presets import cpu_cluster
    from costmodel.specs import ModelSpec
    from planner.config import PlannerConfig
    from planner.planning import plan_batch

    spec = ModelSpec(name="ref-1d-kv1", kind="1d", num_layers=L, hidden=CONFIG.hidden, num_heads=CONFIG.num_heads,
                     num_kv_heads=1, ffn_hidden=CONFIG.ffn_hidden, vocab=CONFIG.vocab, causal=True, mlp="swiglu")
    roomy = cpu_cluster(WORLD, memory_bytes=1e12)
    file = analytic_cost_model(spec, roomy.hardware)
    model = CostModel(file=file, cluster=roomy)
    need = model.fixed_bytes() + 1.05 * float(model.activation_bytes(40, group_size=2, recompute_layers=L))
    cluster = cpu_cluster(WORLD, memory_bytes=need / roomy.memory_cap_fraction)
    samples = [s1d("long", 40)] + [s1d(f"t{i}", t) for i, t in enumerate([5, 9, 3, 7, 6])]
    return plan_batch(samples, cluster=cluster, cost_model=file, config=PlannerConfig.for_budget(0.5))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def run_step(executor: Executor, model: torch.nn.Module, plan: Plan, kind: str) -> float:
    """One planned step on this rank: digest check, micro-batches, world gradient sum.

    Returns:
        This rank's share of the step loss (the world's shares add up to the step loss).
    """
    rank_plan = plan.rank_view(executor.rank)
    executor.begin_step(rank_plan, step=plan.step or 0)
    data = dataset_for(plan, kind, dtype=next(model.parameters()).dtype)
    share = 0.0
    for work in executor.micro_batches(rank_plan, load_sample=data.load):
        out = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
        loss = work.loss(model.token_losses(out, work.targets))  # type: ignore[operator]
        loss.backward()
        share += float(loss.detach())
    executor.sync_gradients(model)
    return share


def worker(rank: int, port: int, out_dir: str) -> None:
    """Every scenario on one rank; results to ``out_dir/rank<r>.pt``."""
    with gloo_rank(rank, WORLD, port, out_dir) as results:
        registry = GroupRegistry(world_size=WORLD, rank=rank, group_sizes=[1, 2, 4])
        executor = Executor(registry=registry)
        for kind, plans in (("1d", plans_1d()), ("2d", plans_2d()), ("3d", plans_2d())):
            for i, plan in enumerate(plans):
                model = build_model(kind)
                results[f"loss_{kind}_{i}"] = run_step(executor, model, plan, kind)
                results[f"grad_{kind}_{i}"] = _grads(model)
            model = build_model(kind, dtype=torch.float32)
            run_step(executor, model, plans[0], kind)
            results[f"grad32_{kind}"] = _grads(model)
            # A few optimizer steps over the plans in turn.
            model = build_model(kind)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for plan in plans * 2:
                opt.zero_grad(set_to_none=True)
                run_step(executor, model, plan.model_copy(update={"step": 0}), kind)
                opt.step()
            results[f"params_{kind}"] = [p.detach().clone() for p in model.parameters()]
        for kind, kv_heads, i in GQA_CASES:
            model = build_model(kind, kv_heads=kv_heads)
            results[f"loss_{kind}_kv{kv_heads}_{i}"] = run_step(executor, model, gqa_plan(kind, i), kind)
            results[f"grad_{kind}_kv{kv_heads}_{i}"] = _grads(model)
        for kv_heads, i in JOINT_CASES:
            model = build_model("3d_joint", kv_heads=kv_heads)
            results[f"loss_3d_joint_kv{kv_heads}_{i}"] = run_step(executor, model, plans_2d()[i], "3d_joint")
            results[f"grad_3d_joint_kv{kv_heads}_{i}"] = _grads(model)
        # A planner-made plan past the key/value head: rank 0 plans, every rank runs the same plan.
        payload: list[str | None] = [planned_gqa_plan().model_dump_json() if rank == 0 else None]
        dist.broadcast_object_list(payload, src=0)
        assert payload[0] is not None
        results["plan_planned_gqa"] = payload[0]
        model = build_model("1d", kv_heads=1)
        results["loss_planned_gqa"] = run_step(executor, model, Plan.model_validate_json(payload[0]), "1d")
        results["grad_planned_gqa"] = _grads(model)
        sync_scenarios.run(rank, registry, {"1d": plans_1d(), "2d": plans_2d()}, results)
        # Digest mismatch: rank 2 holds a different plan (another cost model id).
        plan = plans_1d()[0]
        if rank == 2:
            plan = plan.model_copy(update={"cost_model_id": "other"})
        try:
            executor.begin_step(plan.rank_view(rank), step=0)
            results["mismatch"] = None
        except PlanMismatchError as err:
            results["mismatch"] = str(err)
        # A group size the registry does not have (3): every rank refuses, none waits.
        odd = make_plan([([0, 1, 2], [[(s1d("q", 5), 0)]]), ([3], [[(s1d("r", 2), 0)]])], num_ranks=WORLD)
        try:
            executor.begin_step(odd.rank_view(rank), step=0)
            results["unregistered"] = None
        except ValueError as err:
            results["unregistered"] = str(err)
        # Wrong step on every rank: the plan is for step 0, the loop is at step 5.
        try:
            executor.begin_step(plans_1d()[0].rank_view(rank), step=5)
            results["wrong_step"] = None
        except PlanMismatchError as err:
            results["wrong_step"] = str(err)
