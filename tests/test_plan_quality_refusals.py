"""``bench/plan_quality.py`` on a cell whose batches hold a sample that fits nowhere: the planner's
refusal (``SampleFitsNowhereError``) of a step is recorded with its message and the cell's other
steps are still planned; a cell with every step refused has no figures and says so, in the JSON,
in the views over cells (statuses by workload, the ablation) and in every table that reads a grid
JSON; any other error of the planner still stops the run.

The case is real: video3d-long's longest clip (219,600 tokens) needs more activation memory than
an H200 has left even on a group of 8 with full checkpointing, and the workload's seeded batches
hold it at some steps (two samples a batch) and at every step (sixteen a batch).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import tables  # noqa: E402
from plan_quality_cells import ablation, by_workload, run_cell  # noqa: E402

from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.planning import prepare  # noqa: E402
from planner.prepare import SampleFitsNowhereError  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

WORKLOAD, CLUSTER = "video3d-long", "h200x8"
STEPS = 4


def _refusals(num_samples: int) -> list[str | None]:
    """Per step, the planner's own refusal of the batch (None where it prepares)."""
    spec = WorkloadSpec.preset(WORKLOAD)
    cluster = load_cluster(CLUSTER)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    out: list[str | None] = []
    for step in range(STEPS):
        try:
            prepare(sample_batch(spec, num_samples=num_samples, seed=0, step=step), cluster=cluster,
                    cost_model=cmf, config=PlannerConfig())
            out.append(None)
        except SampleFitsNowhereError as exc:
            out.append(str(exc))
    return out


@pytest.fixture(scope="module")
def cells() -> dict[str, dict[str, Any]]:
    """The partly refused cell (2 samples) and the fully refused one (16), keyed as the grid keys them."""
    return {f"{WORKLOAD}/{CLUSTER}/{n}": run_cell(WORKLOAD, CLUSTER, n, STEPS, PlannerConfig(), lp_bound=False)
            for n in (2, 16)}


def _no_nan(value: Any) -> None:
    json.dumps(value, allow_nan=False)  # raises on NaN or infinity anywhere


def test_a_refused_step_is_recorded_and_the_others_are_planned(cells: dict[str, dict[str, Any]]) -> None:
    expected = _refusals(2)
    assert None in expected and any(expected), f"the case no longer mixes planned and refused steps: {expected}"
    cell = cells[f"{WORKLOAD}/{CLUSTER}/2"]
    s = cell["summary"]
    assert [r["step"] for r in cell["rows"]] == [k for k, e in enumerate(expected) if e is None]
    first = next(e for e in expected if e is not None)
    assert s["refused"] == {"steps": sum(e is not None for e in expected), "of": STEPS, "reason": first}
    assert "fits nowhere" in first and "219,600 tokens" in first
    assert s["planned_steps"] == len(cell["rows"]) and s["steps"] == STEPS
    assert math.isfinite(s["gap_mean"]) and s["speedup_strongest_mean"] is not None
    _no_nan(cell)


def test_a_cell_with_every_step_refused_says_so_without_figures(cells: dict[str, dict[str, Any]]) -> None:
    expected = _refusals(16)
    assert all(expected), expected
    cell = cells[f"{WORKLOAD}/{CLUSTER}/16"]
    s = cell["summary"]
    assert cell["rows"] == [] and s["planned_steps"] == 0
    assert s["refused"] == {"steps": STEPS, "of": STEPS, "reason": expected[0]}
    assert not any(key.startswith(("gap", "speedup_", "cpu_", "latency_")) for key in s), sorted(s)
    _no_nan(cell)


def test_views_over_cells_skip_refused_steps(cells: dict[str, dict[str, Any]]) -> None:
    partly, fully = cells[f"{WORKLOAD}/{CLUSTER}/2"], cells[f"{WORKLOAD}/{CLUSTER}/16"]
    (w,) = by_workload([partly, fully])
    planned = len(partly["rows"])
    assert w["steps"] == planned and w["search_steps"] + w["baseline_steps"] + w["polished_steps"] == planned
    assert w["refused"]["steps"] == STEPS - planned + STEPS and w["refused"]["of"] == 2 * STEPS
    (only_refused,) = by_workload([fully])
    assert only_refused["steps"] == 0 and only_refused["search_beat_strongest_share"] is None
    assert only_refused["refused"] == {"steps": STEPS, "of": STEPS, "reason": fully["summary"]["refused"]["reason"]}
    _no_nan([w, only_refused])

    (abl_partly,) = ablation([WORKLOAD], [CLUSTER], 2, STEPS, cells)
    assert abl_partly["steps"] == planned and abl_partly["refused"]["steps"] == STEPS - planned
    assert math.isfinite(abl_partly["intra_gain_mean"])
    (abl_fully,) = ablation([WORKLOAD], [CLUSTER], 16, STEPS, cells)
    assert abl_fully["steps"] == 0 and abl_fully["refused"]["steps"] == STEPS
    assert "intra_gain_mean" not in abl_fully
    _no_nan([abl_partly, abl_fully])


def test_tables_show_refused_cells_in_words(cells: dict[str, dict[str, Any]]) -> None:
    partly, fully = cells[f"{WORKLOAD}/{CLUSTER}/2"], cells[f"{WORKLOAD}/{CLUSTER}/16"]
    data = {"grid": [partly["summary"], fully["summary"]], "by_workload": by_workload([fully]),
            "budgets": [{**fully["summary"], "budget_s": 0.05}, {**partly["summary"], "budget_s": 0.2}],
            "ablation": ablation([WORKLOAD], [CLUSTER], 16, STEPS, cells)}
    planned = len(partly["rows"])
    whole = f"refused: {STEPS} of {STEPS} steps (sample 'video3d-long:"
    some = f"refused: {STEPS - planned} of {STEPS} steps (sample 'video3d-long:"
    renders = {name: tables.TABLES[name].render(data) for name in (
        "plan-quality", "plan-statuses", "plan-quality-budgets", "plan-intra-ablation",
        "plan-quality-moe")}
    for name, lines in renders.items():
        width = lines[0].count("|")
        assert all(line.count("|") == width for line in lines), (name, lines)  # refusals hold no '|'
        refused_rows = [line for line in lines if whole in line]
        assert refused_rows, (name, lines)
        for row in refused_rows:  # the refusal in place of the figures, shortened to the sample
            assert "fits nowhere)" in row and "GiB" not in row and "%" not in row, row
    grid = renders["plan-quality"]
    (partly_row,) = [line for line in grid if some in line]
    assert f"| {partly['summary']['gap_lp_mean']:.2%} / " in partly_row  # its figures, over the planned steps
    (budget_row,) = [line for line in renders["plan-quality-budgets"] if some in line]
    assert f"/ {planned} |" in budget_row  # CP-SAT's steps out of those planned


def test_any_other_planner_error_still_stops_the_cell() -> None:
    # Group sizes of 3 cannot partition 8 ranks: the planner's ValueError, not a refused sample.
    with pytest.raises(ValueError, match="cannot be partitioned") as exc:
        run_cell(WORKLOAD, CLUSTER, 2, 1, PlannerConfig(group_sizes=(3,)), lp_bound=False)
    assert not isinstance(exc.value, SampleFitsNowhereError)


def test_the_grid_script_finishes_with_a_refused_cell(tmp_path: Path) -> None:
    """The command that stopped at the refused sample now writes its JSON."""
    out = tmp_path / "pq.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_quality.py"), "--quiet", "--cpu", "-1", "--steps", "1",
         "--workloads", WORKLOAD, "--clusters", CLUSTER, "--batches", "64", "--budgets", "--ablation-batch", "0",
         "--out", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text(encoding="utf-8"))
    (cell,) = data["grid"]
    assert cell["refused"]["steps"] == 1 and "fits nowhere" in cell["refused"]["reason"]
    assert data["grid_rows"] == {f"{WORKLOAD}/{CLUSTER}/64": []}
    assert "refused: 1 of 1 steps" in result.stdout
