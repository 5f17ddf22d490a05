"""``bench/load_rankview.py`` end to end, briefly: a real ``dcp serve``, a precomputed epoch and a
real ``wrk`` (skipped where wrk is not installed: it is a Debian package, not a wheel). Every
fetch is answered 2xx, the latency percentiles are ordered, the resident sets are read."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk not installed (apt-get install wrk)")
def test_load_rankview_short_run(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "load_rankview.py"), "--duration-s", "2",
                             "--runs", "1", "--connections", "16", "--threads", "1", "--out", str(out), "-q"],
                            capture_output=True, text=True, timeout=560)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert data["errors"] == 0 and run["non_2xx_3xx"] == 0, run["wrk_output"]
    assert run["requests"] > 16, run["wrk_output"]  # 2 s of 16 connections fetch far more than one each
    assert 0 < run["p50_s"] <= run["p75_s"] <= run["p90_s"] <= run["p99_s"], run
    assert data["epoch"]["views"] == data["epoch"]["steps"] * data["epoch"]["ranks"] > 0
    assert data["rss_before"]["main_bytes"] > 10 * 2**20 and run["rss_after"]["with_children_bytes"] > 0
    assert data["git_commit"] and data["command"]
