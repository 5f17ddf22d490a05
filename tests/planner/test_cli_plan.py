"""``dcp plan`` end to end through the typer app."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app


@pytest.mark.timeout(120)
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


@pytest.mark.timeout(120)
def test_dcp_plan_table_and_unknown_preset() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "-w", "video-short", "-c", "h200x8", "-k", "1", "-b", "32"])
    assert result.exit_code == 0, result.output
    assert "Speedup over each baseline" in result.output and "strongest" in result.output
    bad = runner.invoke(app, ["plan", "-w", "no-such-workload", "-c", "h200x8"])
    assert bad.exit_code != 0
    assert "no-such-workload" in bad.output
