"""The README runs top to bottom as a new user runs it: every ``run`` block in order, in a fresh
directory, as one shell session (``tests/doc_blocks.py``). The service it starts is stopped where
the README says, what each step promises is there, and every file it writes is ignored by git."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from tests.doc_blocks import ROOT, not_ignored, run_page, written

pytestmark = pytest.mark.timeout(600)


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed in ``text`` (curl prints no newline after a body)."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        if isinstance(value, dict):
            found.append(value)
        at = text.find("{", end)
    return found


def test_the_readme_runs_top_to_bottom(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the last block trains under torchrun
    result = run_page(ROOT / "README.md", tmp_path, timeout_s=580)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-5000:]

    assert "llama-7b" in out and "h200x32" in out  # dcp presets
    assert "dcp plan: video-short on h200x32" in out
    assert "epoch tour: done" in out
    with sqlite3.connect(tmp_path / "tour.sqlite") as conn:
        (state,) = conn.execute("SELECT state FROM epochs WHERE id = 'tour'").fetchone()
    assert state == "done"
    assert "<h1>Epoch tour</h1>" in (tmp_path / "tour-report" / "report.html").read_text(encoding="utf-8")
    # The service's answers: the epoch, rank 5's part of step 3, a plan of the two-sample batch.
    answers = _json_objects(out)
    assert any(a.get("epoch_id") == "tour" and a.get("state") == "done" for a in answers), out[-3000:]
    assert any(a.get("rank") == 5 and a.get("step") == 3 for a in answers), out[-3000:]
    plans = [a.get("plan", a) for a in answers]
    assert any(p.get("cluster_name") == "h200x8" and p.get("num_ranks") == 8 for p in plans), out[-3000:]
    # Four ranks trained four steps on the plans the service made, the digests agreeing.
    assert re.search(r"^done: 4 steps of epoch \S+ on 4 ranks", out, flags=re.M), out[-3000:]

    assert not_ignored(written(tmp_path)) == [], "README commands write files git does not ignore"
    assert not list((ROOT / "report").glob("*.png")), "a README command wrote pictures into the source tree"
