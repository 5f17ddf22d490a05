"""docs/serving.md runs top to bottom as written (``tests/doc_blocks.py``): the example manifest
copied into data/, a real ``dcp serve`` on its own port and store, every curl (HTTP errors fail),
the service stopped where the page says, then the offline ``dcp epoch`` into its own file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, not_ignored, run_page, written

pytestmark = pytest.mark.timeout(400)


def test_the_serving_page_runs_top_to_bottom(tmp_path: Path) -> None:
    result = run_page(ROOT / "docs" / "serving.md", tmp_path, timeout_s=380)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-5000:]
    assert (tmp_path / "data" / "train.jsonl").read_text() == (ROOT / "examples/manifests/train.jsonl").read_text()
    assert '"rank":5' in out.replace(" ", "") and '"step":3' in out.replace(" ", "")
    assert "epoch train-s0: done, 8/8 steps in offline.sqlite" in out
    assert "<h1>Epoch e0</h1>" in (tmp_path / "e0.html").read_text()
    report = tmp_path / "offline-report"
    assert (report / "report.html").exists() and (report / "epoch.svg").exists()
    # The offline epoch went to its own file, not into the store the server was serving.
    with sqlite3.connect(tmp_path / "serving.sqlite") as conn:
        assert [row[0] for row in conn.execute("SELECT id FROM epochs")] == ["e0"]
    with sqlite3.connect(tmp_path / "offline.sqlite") as conn:
        assert [row[0] for row in conn.execute("SELECT id FROM epochs")] == ["train-s0"]
    assert not_ignored(written(tmp_path)) == [], "the page's commands write files git does not ignore"
