"""bench/ring_coefficients.py and bench/gpu_ring.sh's coefficient step, on CPU: the fit and the
report from records (the part that needs no GPU), and the script's CPU smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench.ring_coefficients import fit_report, main
from tests.costmodel.test_ring_fit import BLOCK_HALF, MERGE_B, OVERHEAD_S, PHI, _attention, _steps

ROOT = Path(__file__).resolve().parents[1]


def test_the_report_fits_the_records_it_is_given() -> None:
    report = fit_report(_attention(), _steps(), hardware="h200-sxm")
    c = report["coefficients"]
    assert (c["exposed_fraction"], c["step_overhead_s"]) == pytest.approx((PHI, OVERHEAD_S), rel=1e-6)
    assert (c["block_half_tokens"], c["merge_bytes_per_channel"]) == pytest.approx((BLOCK_HALF, MERGE_B), rel=1e-6)
    assert set(report["held_out"]) == {"ring_step", "ring_attention"}
    assert len(report["blocks"]) == 9 and len(report["ring_steps"]) == 9
    row = next(r for r in report["blocks"] if (r["tokens"], r["ring_degree"]) == (4096, 4))
    assert row["block_tokens"] == 1024
    assert row["ring_over_one"] == pytest.approx(1 + BLOCK_HALF * 4 / 4096 + MERGE_B * 3 * 1024 * 512 / 4.8e12
                                                 / (1e-12 * 4096 * 4096 * 512 / 4), rel=1e-9)
    # the published curve the analytic default uses, at the block's length (H200: the H100's FA3 points,
    # head dim 64 without a mask: 392 TFLOP/s at 1k)
    assert row["published_efficiency"]["forward"] == pytest.approx(392 / 989)
    assert fit_report([], [], hardware="h200-sxm")["coefficients"] is None


def test_the_cpu_smoke_run_writes_the_fitted_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rc.json"
    assert main(["--device", "cpu", "--tokens", "128", "256", "--degrees", "2", "4", "--heads", "4", "--head-dim",
                 "16", "--repeats", "2", "--warmup", "0", "--hardware", "h100-sxm", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["coefficients"]["source"].startswith("exposed_fraction and step_overhead_s: published defaults")
    assert len(data["blocks"]) == 4 and data["ring_steps"] == []
    printed = capsys.readouterr().out
    assert "fitted: exposed_fraction" in printed and "needs CUDA" in printed


@pytest.mark.timeout(300)
def test_gpu_ring_sh_coefficient_step_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "coef.json"
    env = {**os.environ, "DEVICE": "cpu", "ONLY": "coefficients", "COEF_OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_ring.sh")], capture_output=True, text=True, env=env,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fitted: exposed_fraction" in proc.stdout
    assert json.loads(out.read_text())["coefficients"] is not None
