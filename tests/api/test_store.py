"""The SQLite plan store: schema migration, epochs, plan rows written once, cost models."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from api.cost_model_store import CostModelConflictError, CostModelStore
from api.store import (
    STORE_SCHEMA_VERSION,
    EpochExistsError,
    PlanStore,
)
from costmodel.presets import default_cost_model_file
from costmodel.specs import Sample
from planner.epoch import StepResult
from planner.plan import RankPlan


def _result(step: int, digest: str = "d" * 64) -> StepResult:
    return StepResult(step=step, plan_json=f'{{"step":{step}}}', digest=digest, gap=0.1,
                      predicted_step_time_s=1.0, speedup_vs_bucket=1.5, solve_time_s=0.01,
                      group_views=((0, 0, f'{{"step":{step}}}'),))


def _steps(n: int) -> list[list[Sample]]:
    return [[Sample(id=f"s{i}", tokens=100 + i)] for i in range(n)]


def test_schema_created_and_reopened(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "p.sqlite"
    store = PlanStore.open(path)
    assert store.schema_version() == STORE_SCHEMA_VERSION
    store.create_epoch("e", spec={"x": 1}, steps=_steps(3))
    store.close()
    again = PlanStore.open(path)
    record = again.get_epoch("e")
    assert record is not None and record.steps_total == 3 and record.state == "queued"
    assert again.pending_steps("e") == [0, 1, 2]
    assert again.batch("e", 2) == [Sample(id="s2", tokens=102)]


def test_newer_schema_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite"
    PlanStore.open(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(ValueError, match="schema version 99"):
        PlanStore.open(path)


def test_steps_written_once(tmp_path: Path) -> None:
    store = PlanStore.open(tmp_path / "p.sqlite")
    store.create_epoch("e", spec={}, steps=_steps(4))
    assert store.write_steps("e", [_result(0), _result(2)]) == 2
    assert store.write_steps("e", [_result(2, "e" * 64), _result(3)]) == 1  # step 2 kept as it was
    record = store.get_epoch("e")
    assert record is not None and record.steps_done == 3
    assert store.pending_steps("e") == [1]
    assert store.get_plan("e", 2) == ("d" * 64, '{"step":2}')
    assert store.get_rank_view("e", 2, 0) == '{"rank":0,"step":2}'
    assert store.get_rank_view("e", 1, 0) is None
    assert store.get_plan("e", 1) is None
    assert [s for s, _, _ in store.get_plans("e", start=0, stop=4)] == [0, 2, 3]
    assert store.summary("e") == {"mean_gap": pytest.approx(0.1), "mean_speedup_vs_bucket": pytest.approx(1.5),
                                  "mean_speedup_vs_strongest": None,  # the results name no strongest
                                  "mean_predicted_step_time_s": pytest.approx(1.0),
                                  "steps_vs_strongest": 0, "steps_vs_bucket": 3}  # the steps each mean is over
    assert store.num_plans() == 3


def test_failed_transaction_leaves_nothing(tmp_path: Path) -> None:
    store = PlanStore.open(tmp_path / "p.sqlite")
    store.create_epoch("e", spec={}, steps=_steps(2))
    bad = StepResult(step=None, plan_json="{}", digest="d" * 64, gap=0, predicted_step_time_s=0,
                     speedup_vs_bucket=None, solve_time_s=0, group_views=((0, 0, "{}"),))
    with pytest.raises(ValueError, match="step index"):
        store.write_steps("e", [_result(0), bad])
    record = store.get_epoch("e")
    assert record is not None and record.steps_done == 0
    assert store.get_plan("e", 0) is None


def test_epoch_id_conflict(tmp_path: Path) -> None:
    store = PlanStore.open(tmp_path / "p.sqlite")
    store.create_epoch("e", spec={}, steps=_steps(2))
    with pytest.raises(EpochExistsError, match="'e' already exists"):
        store.create_epoch("e", spec={}, steps=_steps(5))
    record = store.get_epoch("e")
    assert record is not None and record.steps_total == 2


def test_cost_models(tmp_path: Path) -> None:
    uploaded = CostModelStore(PlanStore.open(tmp_path / "p.sqlite"))
    file = default_cost_model_file("llama-7b", "h200-sxm").model_copy(update={"id": "mine"})
    assert uploaded.put(file) is True
    assert uploaded.put(file) is False
    changed = file.model_copy(update={"notes": "other"})
    with pytest.raises(CostModelConflictError, match="'mine' already exists"):
        uploaded.put(changed)
    assert uploaded.get("mine") == file
    assert [f.id for f in uploaded.list_all()] == ["mine"]
    assert uploaded.delete("mine") is True and uploaded.delete("mine") is False
    assert uploaded.get("mine") is None


def test_migration_from_v1_keeps_plans_and_serves_rank_views(tmp_path: Path) -> None:
    from api.store_schema import _MIGRATIONS
    from costmodel.presets import load_cluster
    from planner.planning import plan_batch

    path = tmp_path / "v1.sqlite"
    with sqlite3.connect(path) as conn:  # a store written by schema version 1
        conn.executescript(_MIGRATIONS[0])
        conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        conn.execute("INSERT INTO epochs(id, state, spec, steps_total, steps_done, created_at) "
                     "VALUES ('old', 'done', '{}', 1, 1, 0)")
        samples = [Sample(id=f"m{i}", tokens=1000 * (i + 1)) for i in range(6)]
        plan = plan_batch(samples, cluster=load_cluster("h200x8"),
                          cost_model=default_cost_model_file("llama-7b", "h200-sxm"), step=0)
        conn.execute("INSERT INTO plans VALUES ('old', 0, ?, ?, 0.1, 1.0, NULL)",
                     (plan.digest(), plan.canonical_json()))
    store = PlanStore.open(path)
    assert store.schema_version() == STORE_SCHEMA_VERSION
    from planner.baselines import strongest

    best = strongest(plan.baselines_s)
    assert best is not None
    assert store.summary("old") == {"mean_gap": pytest.approx(0.1), "mean_speedup_vs_bucket": None,
                                    # backfilled from the stored plan's baselines at schema 8
                                    "mean_speedup_vs_strongest": pytest.approx(best[1] / 1.0),
                                    "mean_predicted_step_time_s": pytest.approx(1.0),
                                    "steps_vs_strongest": 1, "steps_vs_bucket": 0}
    for rank in range(8):
        view = store.get_rank_view("old", 0, rank)
        assert view is not None
        assert RankPlan.model_validate_json(view) == plan.rank_view(rank)
    [figures] = store.step_figures("old", [0])  # no planner wall time was kept before version 7
    assert figures["solver"]["wall_time_s"] is None and figures["num_tokens"] == sum(s.tokens for s in samples)
    with pytest.raises(ValueError, match="rank 8"):
        store.get_rank_view("old", 0, 8)
    assert store.get_rank_view("old", 1, 0) is None


def test_dropped_bounds_are_counted_per_kind_and_path(tmp_path: Path) -> None:
    from api.jobs import _MeteredSink
    from api.metrics import Metrics

    store = PlanStore.open(tmp_path / "m.sqlite")
    store.create_epoch("e", spec={}, steps=[[Sample(id="a", tokens=1)]] * 2)
    metrics = Metrics()
    sink = _MeteredSink(store, "e", metrics)
    dropped = dataclasses.replace(_result(0), dropped_bounds=("partition-lp", "cpsat"))
    assert sink.write_steps([dropped, _result(1)]) == 2
    text = metrics.render().decode()
    assert 'dcp_bound_errors_total{kind="partition-lp",path="epoch"} 1.0' in text
    assert 'dcp_bound_errors_total{kind="cpsat",path="epoch"} 1.0' in text
