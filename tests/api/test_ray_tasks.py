"""What a Ray task runs (``api.ray_tasks``), called here without Ray: same bytes as ``plan_step``,
a failed step returned as its exception beside the others, the per-step deadline."""

from __future__ import annotations

import json

import pytest

from api.pool import DeadlineExceededError
from api.ray_config import RayConfig, host_port
from api.ray_tasks import SharedInputs, plan_step_batch
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from planner.epoch import StepTask, plan_step

from .conftest import FAST, manifest_lines


def _shared(deadline_s: float | None = None, options: dict[str, object] = FAST) -> SharedInputs:
    return SharedInputs(cluster_json=load_cluster("h200x8").model_dump_json(),
                        cost_model_json=default_cost_model_file("llama-7b", "h200-sxm").model_dump_json(),
                        options_json=json.dumps(options), seed=9, deadline_s=deadline_s)


def test_batch_equals_plan_step_and_returns_failures_as_values() -> None:
    samples = [json.loads(line) for line in manifest_lines(16).splitlines()]
    good = json.dumps(samples[:8])
    too_long = json.dumps([{"id": "huge", "tokens": 10**9}])
    out = plan_step_batch(_shared(), [(3, good), (4, too_long), (5, json.dumps(samples[8:]))])
    assert isinstance(out[1], ValueError) and "huge" in str(out[1])
    expected = plan_step(StepTask.create(step=3, samples=[Sample.model_validate(s) for s in samples[:8]],
                                         cluster=load_cluster("h200x8"),
                                         cost_model=default_cost_model_file("llama-7b", "h200-sxm"),
                                         options=FAST, seed=9))
    assert not isinstance(out[0], Exception) and out[0].digest == expected.digest
    assert not isinstance(out[2], Exception) and out[2].step == 5


def test_deadline_stops_a_step() -> None:
    samples = json.dumps([json.loads(line) for line in manifest_lines(64).splitlines()])
    (out,) = plan_step_batch(_shared(deadline_s=1e-4, options={"time_limit_s": 60.0}), [(0, samples)])
    assert isinstance(out, DeadlineExceededError)


@pytest.mark.parametrize(("address", "message"), [("", "must not be empty"), ("head", "no valid port"),
                                                  ("http://head:1", "is not auto"), ("ray://:10001", "is not auto")])
def test_bad_addresses_are_named(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RayConfig(address=address)


def test_addresses() -> None:
    assert host_port("ray://head:10001") == ("head", 10001)
    assert host_port("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert RayConfig(address="auto").steps_per_task == 4
    with pytest.raises(ValueError, match="steps_per_task"):
        RayConfig(address="local", steps_per_task=0)
