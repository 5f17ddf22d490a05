"""The group registry: counts, and a plan's groups checked on every rank before the step."""

from __future__ import annotations

import pytest

from executor.groups import GroupRegistry


def test_layout_check_names_the_unregistered_group() -> None:
    registry = GroupRegistry(world_size=4, rank=0, group_sizes=[1])
    assert registry.num_groups == 0 and registry.creation_time_s >= 0.0
    registry.check_layout([1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"ranks 1\.\.2 has size 2, not one of the registered sizes \[1\]"):
        registry.check_layout([1, 2, 1])
    with pytest.raises(ValueError, match="do not partition a world of 4"):
        registry.check_layout([1, 1, 1])


@pytest.mark.timeout(240)
def test_unregistered_group_size_is_refused_on_every_rank(world4_results: list[dict[str, object]]) -> None:
    for r, res in enumerate(world4_results):
        message = res["unregistered"]
        assert isinstance(message, str), f"rank {r} started a step with an unregistered group"
        assert "ranks 0..2 has size 3" in message
