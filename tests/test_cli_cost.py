"""``dcp cost`` through the real typer app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dcp_cli.main import app

runner = CliRunner()


def test_cost_json_1d() -> None:
    result = runner.invoke(app, ["cost", "1024", "65536", "--cluster", "h200x32", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["cost_model_id"] == "analytic-llama-7b-h200-sxm"
    rows = payload["rows"]
    assert {r["group_size"] for r in rows} == {1, 2, 4, 8, 16, 32}
    long_rows = [r for r in rows if r["tokens"] == 65536]
    assert all(r["fits_full"] for r in long_rows)
    times = [r["time_s_none"] for r in sorted(long_rows, key=lambda r: r["group_size"])]
    assert times == sorted(times, reverse=True)  # a long sample gets faster with more GPUs
    for r in rows:
        assert r["activation_bytes_full"] <= r["activation_bytes_none"]


def test_cost_table_2d() -> None:
    result = runner.invoke(app, ["cost", "15x22x40", "--model", "stdit3-xl", "--cluster", "h200x8"])
    assert result.exit_code == 0, result.output
    assert "analytic-stdit3-xl-h200-sxm" in result.output


def test_cost_bad_input() -> None:
    result = runner.invoke(app, ["cost", "12x", "--model", "stdit3-xl"])
    assert result.exit_code == 2
    assert "12x" in result.output
    result = runner.invoke(app, ["cost", "100", "--cluster", "nope"])
    assert result.exit_code == 2
    assert "unknown cluster preset 'nope'" in result.output
    result = runner.invoke(app, ["cost", "100", "--model", "stdit3-xl"])
    assert result.exit_code == 2


def _header_names(output: str) -> set[str]:
    """The legend's column names (the lines after 'Columns:')."""
    legend = output.split("Columns:", 1)[1]
    return {line.split("  ")[0].strip() for line in legend.splitlines() if line[:1].strip()}


def test_cost_table_fits_80_columns_with_a_legend() -> None:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(
        app, ["cost", "1024", "8192", "131072", "--model", "llama-7b", "--cluster", "h200x32"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.output  # no number cut off
    # the d=1 time, whole: the layers and head at the published curves' efficiencies plus the chunked
    # loss's recompute of the head (2*4096*32000 FLOPs per token at 783.33 TFLOP/s: 44 ms)
    assert "131,072 tokens" in result.output and "34,058" in result.output
    assert _header_names(result.output) >= {"d", "time P", "act P", "a2a", "fits", "efficiency"}
    # the efficiencies the times are priced at: 131,072 tokens run attention on the FA3 plateau
    # (616 and 561 of 989 TFLOP/s: 62% and 57%)
    assert "attention forward/backward 62%/57%" in " ".join(result.output.split())
    header = next(line for line in lines if line.split()[:1] == ["d"])
    assert header.split() == ["d", "none", "sel16", "full", "none", "sel16", "full", "a2a", "fits"]


def test_cost_rejects_non_positive_shapes_plainly() -> None:
    for args in (["0"], ["0x4x4"], ["--", "-5"]):
        result = runner.invoke(app, ["cost", *args])
        assert result.exit_code == 2
        text = " ".join(result.output.translate({ord("│"): " "}).split())  # rich boxes wrap
        assert f"shape '{args[-1]}': tokens, frames, height and width must be positive" in text
        assert "pydantic" not in text and "validation error" not in text


def test_cost_table_shows_every_number_whole_at_80_columns() -> None:
    """A million tokens and more: the table switches to seconds and whole numbers past 1,000
    rather than cutting them to '...', and each shown value is the JSON's."""
    for tokens in ("1000000", "16000000"):
        table = runner.invoke(app, ["cost", tokens, "--cluster", "h200x64"], env={"COLUMNS": "80"})
        assert table.exit_code == 0, table.output
        assert "…" not in table.output and "..." not in table.output, table.output
        assert "(times in s)" in table.output
        rows = json.loads(runner.invoke(app, ["cost", tokens, "--cluster", "h200x64", "--json"]).output)["rows"]
        one = next(r for r in rows if r["group_size"] == 1)
        line = next(row for row in table.output.splitlines() if row.split()[:1] == ["1"])
        assert f"{one['time_s_none']:,.0f}" in line.split(), (line, one["time_s_none"])
