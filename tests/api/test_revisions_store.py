"""Frozen steps: a step any rank fetched is never replaced; the others are, with their views."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_fetch_writes_nothing_and_the_freeze_is_persisted_later(tmp_path: Path) -> None:
    store = PlanStore.open(tmp_path / "w.sqlite")
    steps = _steps()
    store.create_epoch("e", spec={"cost_model_id": FILE.id}, steps=steps)
    store.write_steps("e", [_plan(b, i, scale=1.0) for i, b in enumerate(steps)])
    revisions = RevisionStore(store)

    def stored() -> int:
        row = store._conn().execute("SELECT frozen_through FROM epoch_recalibration WHERE epoch_id='e'").fetchone()
        return -1 if row is None else int(row[0])

    changes = store._conn().total_changes
    assert revisions.fetch_rank_view("e", 2, 0, freeze=False) is not None
    assert revisions.state("e").frozen_through == -1  # an anonymous read freezes nothing
    assert revisions.fetch_rank_view("e", 2, 0) is not None
    assert revisions.state("e").frozen_through == 2 and stored() == -1  # frozen in memory, not written
    assert store._conn().total_changes == changes
    # Re-plans see it at once; the store gets it from the flusher (or at close).
    assert revisions.replace_unfrozen("e", [_plan(steps[2], 2, scale=3.0)], rev=1) == ([], [2])
    revisions.close()
    assert stored() == 2
    again = RevisionStore(store)
    assert again.state("e").frozen_through == 2  # a restart keeps it
    again.close()
    store.close()
