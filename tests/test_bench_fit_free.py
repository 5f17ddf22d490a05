"""``bench/fit_free.py`` end to end: every generated profile of a plausible peak structure (Llama,
STDiT, Llama-3.1-8B, Wan2.1-14B; noise-free and 1% noise) fits without force, its held-out peak
within 5% and the full model's peaks (depths never profiled) near the truth; the misfit is refused
as a model-form error and, forced, carries one margin that does not stack on the safety fraction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


def test_fit_free_bench(tmp_path: Path) -> None:
    out = tmp_path / "fit_free.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_free.py"), "--out", str(out)],
                            capture_output=True, text=True, timeout=560)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {r["model"] for r in data["rows"]} == {"llama-7b", "stdit3-xl", "llama-3.1-8b", "wan2.1-14b"}
    for row in data["rows"]:
        assert row["accepted"], row
        exact = row["noise"] == 0
        assert row["heldout_peak_mape"] <= (1e-9 if exact else 0.05), row
        assert row["insample_peak_mape"] <= (1e-9 if exact else 0.05), row
        assert row["full_depth_peak_error_max"] <= (1e-6 if exact else 0.02), row
        assert row["diagnosis"] == ("exact" if exact else "noise"), row
        assert row["margin"] == 0.0
    misfit = data["misfit"]
    assert misfit["refused"] and "model-form error, not noise" in misfit["refusal"]
    margin, priced = misfit["margin"], misfit["priced"]
    assert margin > 0.05 and priced["reserved_fraction"] == pytest.approx(max(0.05, margin / (1 + margin)))
