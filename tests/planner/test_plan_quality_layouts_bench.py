"""``bench/plan_quality.py --layouts`` end to end on a tiny cell: every mode's plan is checked by
the validator, forced modes keep their layouts, and the summary is what the rows say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_layouts_mode_plans_every_layout_and_summarises_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "layouts.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_quality.py"), "--layouts", "--workloads", "text-millionctx",
         "--batches", "16", "--steps", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=280, check=False)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["modes"] == ["auto", "ulysses", "ring"]
    (cell,) = result["cells"]
    rows, summary = cell["rows"], cell["summary"]
    assert len(rows) == 2 and summary["heads"] == 32
    for row in rows:
        for mode in ("auto", "ulysses", "ring"):
            r = row[mode]
            assert r["feasible"] and r["valid"], (mode, r.get("problems"))
            layouts = [tuple(map(int, x.split("x"))) for x in r["layouts"]]  # "u x r"
            if mode == "ulysses":
                assert all(rd == 1 for _, rd in layouts)
            if mode == "ring":
                assert all(u == 1 for u, _ in layouts)
            assert r["step_time_s"] >= r["bound_s"] * (1 - 1e-6)
        assert row["baselines_s"]["strongest"] == min(t for n, t in row["baselines_s"].items()
                                                      if n not in ("naive", "strongest"))
    for mode in ("auto", "ulysses", "ring"):
        times = [r[mode]["step_time_s"] for r in rows]
        assert summary[mode]["step_time_mean_s"] == pytest.approx(sum(times) / len(times))
        assert summary[mode]["valid_steps"] == 2
    ratio = [r["ulysses"]["step_time_s"] / r["auto"]["step_time_s"] for r in rows]
    assert summary["auto_over_ulysses_mean"] == pytest.approx(sum(ratio) / len(ratio))
    assert "x strong" in run.stdout
