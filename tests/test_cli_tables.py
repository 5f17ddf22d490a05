"""What a new user reads: tables within 80 columns with a legend for every column, presets listed,
and plain errors (no traceback) when an extra is missing."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from costmodel.presets import cluster_names, hardware_names, model_names, workload_names
from dcp_cli.main import app

runner = CliRunner(env={"COLUMNS": "80"})


def _check_tables(output: str) -> None:
    """Every line within 80 columns, nothing cut off, each table header explained in its legend."""
    lines = output.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert "…" not in output
    blocks = output.split("Columns:")
    assert len(blocks) >= 2, output
    for table, legend in itertools.pairwise(blocks):
        rule = max(i for i, line in enumerate(table.splitlines()) if set(line.strip()) == {"─"})
        header = table.splitlines()[rule - 1]
        explained = " ".join(line[:18] for line in legend.splitlines())
        for name in header.split():
            assert name in explained, (name, header, legend)


def test_presets_lists_every_kind_within_80_columns() -> None:
    result = runner.invoke(app, ["presets"])
    assert result.exit_code == 0, result.output
    for name in [*model_names(), *hardware_names(), *cluster_names(), *workload_names()]:
        assert name in result.output
    assert "analytic-llama-7b-h200-sxm" in result.output
    _check_tables(result.output)
    data = json.loads(runner.invoke(app, ["presets", "clusters", "--json"]).output)
    assert [c["name"] for c in data["clusters"]] == cluster_names()
    bad = runner.invoke(app, ["presets", "nosuch"])
    assert bad.exit_code == 2 and "models" in bad.output


@pytest.mark.timeout(120)
def test_plan_tables_fit_80_columns_and_explain_baselines() -> None:
    result = runner.invoke(app, ["plan", "-w", "text-longtail", "-c", "h200x64", "-k", "2", "-b", "64", "-q"])
    assert result.exit_code == 0, result.output
    _check_tables(result.output)
    for baseline in ("bucket-sp4", "static-best", "megatron-dyncp", "dcp-greedy", "strongest"):
        legend = result.output.rsplit("Columns:", 1)[1]
        assert any(line.startswith(f"{baseline} ") for line in legend.splitlines()), baseline
    # The headline leads the baselines table: the strongest first, the paper's bucket-sp4 second.
    table = result.output.split("Speedup over each baseline", 1)[1].split("Columns:", 1)[0]
    rows = [line.split()[0] for line in table.splitlines() if line.strip() and "─" not in line]
    assert rows[0] == "baseline", rows
    rows = rows[1:]
    assert rows[:2] == ["strongest", "bucket-sp4"], rows


def test_cost_table_legend() -> None:
    result = runner.invoke(app, ["cost", "4096", "15x22x40", "--model", "stdit3-xl"])
    assert result.exit_code == 2 and "FRAMESxHEIGHTxWIDTH" in result.output
    result = runner.invoke(app, ["cost", "15x22x40", "120x45x80", "--model", "stdit3-xl"])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80 and "…" not in result.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["profile", "--out", "p.jsonl"], ["profile-comm", "--out", "c.jsonl"]])
def test_profiling_without_torch_says_what_to_install(tmp_path: Path, command: list[str]) -> None:
    # A real interpreter in which torch cannot be imported (as after `pip install dcp-planner`). A
    # finder refuses it, so `torch` is absent from sys.modules as without the package (a None entry
    # there is not the same: scipy's array-API helpers read any `torch` entry they find).
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from dcp_cli.main import app\n"
            f"app({command!r}, prog_name='dcp')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                            cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    text = " ".join(result.stderr.translate({ord("│"): " "}).split())
    assert "needs torch: pip install 'dcp-planner[torch]'" in text
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())
