"""docs/cli.md runs top to bottom as written (``tests/doc_blocks.py``): presets and costs,
``--model-config`` in dcp cost, plan, epoch and profile, ``--model`` with a new preset, the
planner on sampled batches and the pictures; and says what the page promises."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, not_ignored, run_page, written

pytestmark = pytest.mark.timeout(600)


def test_the_cli_page_runs_top_to_bottom(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # dcp profile
    result = run_page(ROOT / "docs" / "cli.md", tmp_path, timeout_s=580)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-5000:]
    # dcp cost of Llama-3.1-8B: group sizes 16 and 32, past its 8 KV heads.
    sizes = [int(line.split()[0]) for line in out.split("131,072 tokens", 2)[2].split("Columns:", 1)[0].splitlines()
             if line.strip()[:1].isdigit()]
    assert sizes == [1, 2, 4, 8, 16, 32]
    assert "epoch videos-s0: done, 8/8 steps" in out
    with sqlite3.connect(tmp_path / "video-plans.sqlite") as conn:
        spec = json.loads(conn.execute("SELECT spec FROM epochs").fetchone()[0])
    assert spec["model"]["name"] == "wan2.1-1.3b" and spec["model"]["kind"] == "3d"
    header = json.loads((tmp_path / "qwen3.jsonl").read_text().splitlines()[0])
    assert header["model"]["name"] == "qwen3-8b" and header["profiled"]["hidden"] == 128
    # The pictures: a plan's, the same plan read back from its file, an epoch's.
    for path in ("dcp-report/gantt.svg", "dcp-report/plan.json", "plan-again/gantt.svg",
                 "epoch-report/epoch.svg", "epoch-report/report.html"):
        assert (tmp_path / path).is_file(), path
    assert "<h1>Epoch e0</h1>" in (tmp_path / "epoch-report" / "report.html").read_text(encoding="utf-8")
    assert not_ignored(written(tmp_path)) == [], "the page's commands write files git does not ignore"
    assert not list((ROOT / "report").glob("*.png")), "a command wrote pictures into the source tree"
