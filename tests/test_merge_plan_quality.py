"""``bench/merge_plan_quality.py`` joins per-workload runs of ``bench/plan_quality.py`` into the
JSON one process would write: the committed grid, cut into one part per workload (each with its
own command and load), merges back to the same cells, step rows, statuses, budgets and ablation
in the same order; parts of different grids or overlapping workloads are refused."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from merge_plan_quality import merge  # noqa: E402

GRID = json.loads((ROOT / "bench" / "results" / "plan_quality.json").read_text(encoding="utf-8"))


def _part(workload: str, load: float) -> dict[str, Any]:
    part = {k: copy.deepcopy(GRID[k]) for k in ("batches", "steps", "clusters", "default_config", "rss")}
    part.update({
        "command": f"python bench/plan_quality.py --workloads {workload}", "git_commit": "abc1234",
        "machine": {**GRID["machine"], "loadavg_at_start": [load, 1.0, 1.0], "loadavg_at_end": [load + 1, 2.0, 2.0]},
        "workloads": [workload],
        "by_workload": [w for w in GRID["by_workload"] if w["workload"] == workload],
        "grid": [c for c in GRID["grid"] if c["workload"] == workload],
        "grid_rows": {k: v for k, v in GRID["grid_rows"].items() if k.startswith(f"{workload}/")},
        "budgets": [b for b in GRID["budgets"] if b["workload"] == workload],
        "ablation": [a for a in GRID["ablation"] if a["workload"] == workload],
    })
    return part


def test_parts_merge_back_to_one_grid_in_its_order() -> None:
    workloads = GRID["workloads"]
    assert len(workloads) >= 2
    parts = [_part(w, float(i)) for i, w in enumerate(reversed(workloads))]  # any order in
    merged = merge(parts, how="test")
    for key in ("workloads", "by_workload", "grid", "grid_rows", "budgets", "ablation"):
        assert merged[key] == GRID[key], key
    assert list(merged["grid_rows"]) == list(GRID["grid_rows"])
    # The order of plan_quality.py's own loops (main(): workload, cluster, batch; budgets outside
    # workloads; ablation workload, cluster), not merely the committed file's.
    assert workloads == sorted(workloads)
    assert [(c["workload"], c["cluster"], c["num_samples"]) for c in merged["grid"]] == [
        (w, cl, n) for w in workloads for cl in GRID["clusters"] for n in GRID["batches"]]
    assert [(b["budget_s"], b["workload"]) for b in merged["budgets"]] == [
        (budget, w) for budget in (0.05, 0.2, 1.0) for w in workloads]
    assert [(a["workload"], a["cluster"]) for a in merged["ablation"]] == [
        (w, cl) for w in workloads for cl in GRID["clusters"]]
    assert merged["command"] == "test" and merged["git_commit"] == "abc1234"
    assert merged["machine"]["loadavg_at_start"][0] == len(workloads) - 1  # the highest a part saw
    assert [p["workloads"] for p in merged["parts"]] == [[w] for w in workloads]


def test_parts_of_other_grids_or_the_same_workload_are_refused() -> None:
    a, b = _part(GRID["workloads"][0], 1.0), _part(GRID["workloads"][1], 1.0)
    with pytest.raises(ValueError, match="in more than one part"):
        merge([a, copy.deepcopy(a)], how="test")
    b["steps"] = GRID["steps"] + 1
    with pytest.raises(ValueError, match="parts differ in 'steps'"):
        merge([a, b], how="test")
    del a["grid"]
    with pytest.raises(ValueError, match="has no 'grid'"):
        merge([a], how="test")
