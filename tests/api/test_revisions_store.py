"""Frozen steps: a step any rank fetched is never replaced; the others are, with their views."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from api.revisions_store import RevisionStore
from api.store import PlanStore
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.recalibrate import TermScales, scale_file
from costmodel.specs import Sample
from planner.epoch import StepResult, plan_samples
from planner.plan import RankPlan

CLUSTER = load_cluster("h200x8")
FILE = default_cost_model_file("llama-7b", "h200-sxm")
OPTIONS = {"time_limit_s": 5.0, "use_cpsat": False}


def _steps() -> list[list[Sample]]:
    return [[Sample(id=f"s{step}-{i}", tokens=1024 * (1 + (i + step) % 8)) for i in range(8)]
            for step in range(6)]


def _plan(samples: list[Sample], step: int, *, scale: float) -> StepResult:
    file = FILE if scale == 1.0 else scale_file(FILE, TermScales(compute=scale), new_id=f"{FILE.id}@1")
    return plan_samples(samples, cluster=CLUSTER, cost_model=file, options=OPTIONS, step=step, seed=step)


def test_fetched_steps_are_frozen_and_the_rest_replaced(tmp_path: Path) -> None:
    store = PlanStore.open(tmp_path / "s.sqlite")
    steps = _steps()
    store.create_epoch("e", spec={"cost_model_id": FILE.id}, steps=steps)
    store.write_steps("e", [_plan(b, i, scale=1.0) for i, b in enumerate(steps)])
    revisions = RevisionStore(store)
    assert revisions.fetch_rank_view("e", 9, 0) is None and revisions.state("e").frozen_through == -1
    view = revisions.fetch_rank_view("e", 3, 0, fast=True)
    assert view is not None and revisions.state("e").frozen_through == 3
    before = {s: store.get_plan("e", s) for s in range(6)}
    time_before = store.summary("e")["mean_predicted_step_time_s"]

    replanned = [_plan(steps[s], s, scale=4.0) for s in range(2, 6)]
    done, left = revisions.replace_unfrozen("e", replanned, rev=1)
    assert done == [4, 5] and left == [2, 3]
    for s in range(4):
        assert store.get_plan("e", s) == before[s]
    for s in (4, 5):
        digest, plan_json = store.get_plan("e", s) or ("", "")
        assert digest != before[s][0] and json.loads(plan_json)["cost_model_id"] == f"{FILE.id}@1"
        served = RankPlan.model_validate_json(revisions.fetch_rank_view("e", s, 0) or "")
        assert served.plan_digest == digest and served.cost_model_id == f"{FILE.id}@1"
    assert revisions.step_revisions("e") == {4: 1, 5: 1}
    assert store.summary("e")["mean_predicted_step_time_s"] > time_before  # running sums follow
    # Fetching step 5 froze everything: a later revision changes nothing.
    assert revisions.replace_unfrozen("e", replanned, rev=2) == ([], [2, 3, 4, 5])
    revisions.close()
    store.close()


def test_a_fetch_writes_its_freeze_before_answering_and_a_locked_store_still_serves(tmp_path: Path) -> None:
    store = PlanStore.open(tmp_path / "w.sqlite")
    steps = _steps()
    store.create_epoch("e", spec={"cost_model_id": FILE.id}, steps=steps)
    store.write_steps("e", [_plan(b, i, scale=1.0) for i, b in enumerate(steps)])
    revisions = RevisionStore(store)

    def stored() -> int:
        row = store._conn().execute("SELECT frozen_through FROM epoch_recalibration WHERE epoch_id='e'").fetchone()
        return -1 if row is None else int(row[0])

    assert revisions.fetch_rank_view("e", 2, 0, freeze=False) is not None
    assert revisions.state("e").frozen_through == -1 and stored() == -1  # an anonymous read freezes nothing
    assert revisions.fetch_rank_view("e", 2, 0, fast=True) is not None
    assert stored() == 2  # in the store before the view was returned (survives a kill -9)
    changes = store._conn().total_changes
    assert revisions.fetch_rank_view("e", 1, 0, fast=True) is not None  # already frozen: no write
    assert store._conn().total_changes == changes and stored() == 2
    # Another process holds the write lock: the fast path leaves the fetch to a thread, which waits
    # briefly, then freezes in memory and serves; the flusher writes it once the lock is gone.
    other = sqlite3.connect(tmp_path / "w.sqlite", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError):
            revisions.fetch_rank_view("e", 3, 0, fast=True)
        assert revisions.fetch_rank_view("e", 3, 0) is not None
        assert revisions.state("e").frozen_through == 3 and stored() == 2
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert revisions.replace_unfrozen("e", [_plan(steps[3], 3, scale=3.0)], rev=1) == ([], [3])
    revisions.close()
    assert stored() == 3
    again = RevisionStore(store)
    assert again.state("e").frozen_through == 3  # a restart keeps it
    again.close()
    store.close()
