"""The plan wire schema: round-trip, digest, rank views, partition check."""

from __future__ import annotations

import json

import pytest

from costmodel.specs import Sample
from planner.plan import (
    PLAN_SCHEMA_VERSION,
    GroupPlan,
    LossNormalizer,
    LowerBound,
    MicroBatch,
    Plan,
    PlannedSample,
    RankPlan,
    SolverInfo,
)


def _mb(*ids_tokens: tuple[str, int], k: int = 0) -> MicroBatch:
    return MicroBatch(
        samples=[PlannedSample(sample=Sample(id=i, tokens=t), recompute_layers=k, predicted_time_s=0.1,
                               predicted_activation_bytes=1e6) for i, t in ids_tokens],
        predicted_time_s=0.2, predicted_peak_mem_bytes=2e6)


def _plan(groups: list[GroupPlan], num_ranks: int = 4) -> Plan:
    return Plan(step=3, num_ranks=num_ranks, groups=groups, predicted_step_time_s=1.0, grad_sync_time_s=0.1,
                lower_bound=LowerBound(value_s=0.8, kind="area"),
                solver=SolverInfo(status="OPTIMAL", method="cpsat", wall_time_s=0.01),
                loss_normalizer=LossNormalizer(kind="tokens", total=600),
                cost_model_id="analytic-llama-7b-h200-sxm", cluster_name="h200x8")


def _groups() -> list[GroupPlan]:
    return [
        GroupPlan(ranks=[0, 1], micro_batches=[_mb(("a", 300)), _mb(("b", 100), k=2)],
                  predicted_time_s=0.4, predicted_peak_mem_bytes=2e6),
        GroupPlan(ranks=[2], micro_batches=[_mb(("c", 100))], predicted_time_s=0.2, predicted_peak_mem_bytes=2e6),
        GroupPlan(ranks=[3], micro_batches=[_mb(("d", 100))], predicted_time_s=0.2, predicted_peak_mem_bytes=2e6),
    ]


def test_round_trip_and_digest() -> None:
    plan = _plan(_groups())
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert again.digest() == plan.digest()
    assert plan.gap == pytest.approx(0.25)
    assert plan.sample_ids == ["a", "b", "c", "d"]
    other = GroupPlan(ranks=[3], micro_batches=[_mb(("e", 100))], predicted_time_s=0.2, predicted_peak_mem_bytes=2e6)
    changed = _plan([*_groups()[:2], other])
    assert changed.digest() != plan.digest()


def test_rank_view() -> None:
    plan = _plan(_groups())
    view = plan.rank_view(1)
    assert view.group.ranks == [0, 1]
    assert view.index_in_group == 1
    assert view.group_sizes == [2, 1, 1]
    assert view.plan_digest == plan.digest()
    assert RankPlan.model_validate_json(view.model_dump_json()) == view
    with pytest.raises(ValueError, match="rank 9 is not in this plan's world of 4"):
        plan.rank_view(9)


def test_groups_must_partition_ranks() -> None:
    with pytest.raises(ValueError, match=r"do not partition ranks 0..3: got \[0, 1, 2\]"):
        _plan(_groups()[:2])
    with pytest.raises(ValueError, match=r"group ranks \[0, 2\] are not contiguous"):
        GroupPlan(ranks=[0, 2], predicted_time_s=0, predicted_peak_mem_bytes=0)


def test_version_1_plans_still_load_and_only_version_2_says_polished_baseline() -> None:
    plan = _plan(_groups())
    assert plan.schema_version == PLAN_SCHEMA_VERSION == 2
    # A plan stored by version 1 (before POLISHED_BASELINE) loads as it is, digest unchanged.
    wire = json.loads(plan.model_dump_json())
    wire["schema_version"] = 1
    old = Plan.model_validate(wire)
    assert old.schema_version == 1
    assert Plan.model_validate_json(old.model_dump_json()).digest() == old.digest() != plan.digest()
    wire["solver"]["status"] = "POLISHED_BASELINE"
    with pytest.raises(ValueError, match="POLISHED_BASELINE' needs schema_version 2"):
        Plan.model_validate(wire)
    wire["schema_version"] = 2
    assert Plan.model_validate(wire).solver.status == "POLISHED_BASELINE"
    wire["schema_version"] = 3
    with pytest.raises(ValueError, match=r"schema_version=3 is not supported \(expected one of \(1, 2\)\)"):
        Plan.model_validate(wire)
