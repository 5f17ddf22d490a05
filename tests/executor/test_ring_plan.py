"""The attention layout in the plan schema (``GroupPlan.ring_degree``) and the validator's checks.

Old plans load unchanged and a pure-Ulysses plan keeps its JSON bytes and digest; a bad layout is
an error naming the group and the value."""

from __future__ import annotations

import json

import pytest

from costmodel.evaluate import CostModel
from planner.plan import GroupPlan, Plan
from planner.validate import validate_plan
from tests.executor.helpers import make_plan, s1d
from tests.planner.tiny import tiny_cluster, tiny_cost_model


def _plan(ring_degree: int = 1, tokens: int = 12) -> Plan:
    plan = make_plan([([0, 1, 2, 3], [[(s1d("a", tokens), 0), (s1d("b", 9), 1)]])], num_ranks=4)
    if ring_degree == 1:
        return plan
    group = plan.groups[0].model_copy(update={"ring_degree": ring_degree})
    return Plan.model_validate({**plan.model_dump(), "groups": [GroupPlan.model_validate(group.model_dump())]})


def test_pure_ulysses_plans_keep_their_bytes_and_digest() -> None:
    plan = _plan()
    data = json.loads(plan.canonical_json())
    assert "ring_degree" not in data["groups"][0]
    assert "ring_degrees" not in plan.rank_view(0).model_dump()
    # A plan written before the field existed (its JSON has no ring_degree) loads as (d, 1) and
    # gives back the same bytes, hence the same digest.
    old = json.dumps(data, sort_keys=True, separators=(",", ":"))
    loaded = Plan.model_validate_json(old)
    assert loaded.groups[0].ring_degree == 1 and loaded.groups[0].ulysses_degree == 4
    assert loaded.canonical_json() == old and loaded.digest() == plan.digest()


def test_a_ring_layout_travels_in_the_plan_and_the_rank_view() -> None:
    plan = _plan(ring_degree=2)
    assert (plan.groups[0].ulysses_degree, plan.groups[0].ring_degree) == (2, 2)
    data = json.loads(plan.canonical_json())
    assert data["groups"][0]["ring_degree"] == 2
    assert Plan.model_validate_json(plan.canonical_json()).digest() == plan.digest()
    assert plan.digest() != _plan().digest()
    view = plan.rank_view(3)
    assert view.ring_degrees == [2] and view.group.ring_degree == 2


def test_a_ring_degree_must_divide_the_group() -> None:
    plan = _plan()
    group = plan.groups[0].model_dump()
    with pytest.raises(ValueError, match=r"ranks 0..3: ring_degree=3 does not divide the group size 4"):
        GroupPlan.model_validate({**group, "ring_degree": 3})
    with pytest.raises(ValueError, match="ring_degree"):
        GroupPlan.model_validate({**group, "ring_degree": 0})


def test_the_validator_checks_ring_layouts() -> None:
    cm = CostModel(file=tiny_cost_model(num_heads=2), cluster=tiny_cluster(num_gpus=4, gpus_per_node=4))
    samples = [s1d("a", 12), s1d("b", 9)]
    where = "group at rank 0 (size 4, ulysses_degree=1 x ring_degree=4)"
    problems = validate_plan(_plan(ring_degree=4), samples, cost_model=cm)
    # a group of 4 past the 2 heads is fine as a ring of 4; sample b is too short to cut in 8
    assert not any("which the heads do not allow" in p for p in problems), problems
    assert f"{where}: sample 'b' has 9 tokens, fewer than the 8 chunks" not in " ".join(problems)
    short = validate_plan(_plan(ring_degree=4, tokens=7), [s1d("a", 7), s1d("b", 9)], cost_model=cm)
    assert any(p.startswith(f"{where}: sample 'a' has 7 tokens, fewer than the 8 chunks") for p in short), short
    # Ulysses over 4 ranks cannot split 2 heads, so pure Ulysses at size 4 is refused
    assert any("has size 4, which the heads do not allow" in p for p in validate_plan(_plan(), samples, cost_model=cm))
    # 4 = 2 x 2 splits the 2 heads over 2 ranks: allowed
    assert not any("not allowed by the heads" in p for p in validate_plan(_plan(ring_degree=2), samples, cost_model=cm))
    cm4 = CostModel(file=tiny_cost_model(num_heads=3), cluster=tiny_cluster(num_gpus=4, gpus_per_node=4))
    bad = validate_plan(_plan(ring_degree=2), samples, cost_model=cm4)
    assert any("ulysses_degree=2 is not allowed by the heads (num_heads=3" in p for p in bad), bad
    # the cost model prices ring layouts (costmodel.evaluate, layout): nothing says otherwise
    assert not any("does not price" in p for p in problems), problems


def test_the_serialization_schema_keeps_every_field() -> None:
    """The JSON-leaving serializer must not hide the plan's fields from OpenAPI (a serializer with a
    return annotation turns the schema into a bare object)."""
    from planner.plan import RankPlan

    group = GroupPlan.model_json_schema(mode="serialization")
    assert {"ranks", "micro_batches", "ring_degree"} <= set(group["properties"])
    rank = RankPlan.model_json_schema(mode="serialization")
    assert {"group", "group_sizes", "ring_degrees"} <= set(rank["properties"])
