"""``dcp plan`` end to end through the typer app."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app


def test_dcp_plan_json_reports_every_step_and_the_total() -> None:
    result = CliRunner().invoke(app, ["plan", "--workload", "text-longtail", "--cluster", "h200x8",
                                      "--steps", "2", "--batch-size", "48", "--seed", "3",
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [row["step"] for row in data["steps"]] == [0, 1]
    for row in data["steps"]:
        assert row["num_samples"] == 48
        assert set(row["baselines_s"]) >= {"bucket-sp4", "static-best", "megatron-dyncp",
                                           "dcp-greedy", "strongest"}
        headline = [v for k, v in row["speedups"].items() if k not in ("naive", "strongest")]
        assert row["speedups"]["strongest"] == pytest.approx(min(headline))
        assert row["gap"] >= 0
    assert data["total"]["steps"] == 2
    assert data["total"]["step_time_s"] == pytest.approx(
        sum(row["step_time_s"] for row in data["steps"]))


def test_dcp_plan_table_and_unknown_preset() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "-w", "video-short", "-c", "h200x8", "-k", "1", "-b", "32"])
    assert result.exit_code == 0, result.output
    assert "Speedup over each baseline" in result.output and "strongest" in result.output
    bad = runner.invoke(app, ["plan", "-w", "no-such-workload", "-c", "h200x8"])
    assert bad.exit_code != 0
    assert "no-such-workload" in bad.output


def test_dcp_plan_totals_are_over_the_steps_each_baseline_planned() -> None:
    """text-millionctx at 32 samples on 64 GPUs: ``naive`` (SP 1) cannot hold four of the five
    steps' longest samples. Its total is its time over the one step it planned against the plans'
    time over that same step, and both outputs say how many steps that is."""
    runner = CliRunner()
    args = ["plan", "-w", "text-millionctx", "-c", "h200x64", "-k", "5", "-b", "32", "-q"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    rows, total = data["steps"], data["total"]
    held = [r for r in rows if "naive" in r["baselines_s"]]
    assert 0 < len(held) < len(rows)  # the case this test is about
    assert total["baseline_steps"]["naive"] == len(held)
    assert total["baselines_s"]["naive"] == pytest.approx(sum(r["baselines_s"]["naive"] for r in held))
    assert total["plans_s"]["naive"] == pytest.approx(sum(r["step_time_s"] for r in held))
    per_step = [r["speedups"]["naive"] for r in held]
    # A ratio of sums over the same steps lies within its steps' ratios (the old total divided by
    # all five plans fell below every one of them).
    assert min(per_step) * (1 - 1e-9) <= total["speedups"]["naive"] <= max(per_step) * (1 + 1e-9)
    for name, count in total["baseline_steps"].items():
        steps = [r for r in rows if name in r["baselines_s"]]
        assert count == len(steps)
        assert total["speedups"][name] == pytest.approx(
            sum(r["baselines_s"][name] for r in steps) / sum(r["step_time_s"] for r in steps))
    assert sum(total["bound_kinds"].values()) == len(rows)
    table = runner.invoke(app, args, env={"COLUMNS": "100"})
    assert table.exit_code == 0, table.output
    naive_row = next(line for line in table.output.splitlines() if line.strip().startswith("naive "))
    assert f"{len(held)} of {len(rows)}" in naive_row
    assert "partition-lp" in table.output  # the legend names every bound
