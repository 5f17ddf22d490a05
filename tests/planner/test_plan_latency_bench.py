"""``bench/plan_latency.py`` end to end on a tiny cell: both sides the same checkout, so every
step's plan digest agrees, and the JSON holds the per-step CPU times it summarises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ab_run_on_the_same_checkout_gives_the_same_plans(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plan_latency.py"), "--cells",
         "video-short:h200x8:32", "text-longtail:h200x8:32", "--steps", "2", "--reps", "1",
         "--baseline", str(ROOT), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert set(result["cells"]) == {"video-short:h200x8:32", "text-longtail:h200x8:32"}
    for row in result["cells"].values():
        assert row["same_digests"] == 2
        for side in ("a", "b"):
            assert len(row[side]["cpu_ms"]) == 2
            assert row[side]["p50_ms"] > 0
    assert "B/A" in run.stdout


def test_bad_counts_are_refused() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "plan_latency.py"), "--steps", "0"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode != 0
    assert "--steps and --reps must be at least 1" in run.stderr
