"""The README's CPU quick tour runs as written: a small Llama config is profiled at its own shape
on the CPU, fitted, and planned on ``cpu:2`` with the fitted file (issue 23: the 7B fit of the old
block fitted no CPU rank). The files it writes and the plan it prints are checked; that a fitted
file plans only the model it was fitted for is tested in tests/planner/test_cli_plan_cost_model.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from costmodel.model_config import model_spec_from_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = ROOT / "examples" / "tiny-llama"

pytestmark = pytest.mark.timeout(400)


def _tour_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- readme-test: tests/test_readme_cpu_tour.py -->\n```bash\n(.*?)```", readme, flags=re.S)
    assert len(blocks) == 1, "README.md has no (or more than one) block marked tests/test_readme_cpu_tour.py"
    return blocks[0]


def _run(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}, timeout=380, check=False)


def test_readme_cpu_tour_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # dcp profile, torchrun
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    block = _tour_block()
    for step in ("dcp profile", "profile-comm", "dcp fit", "dcp plan"):
        assert step in block
    result = _run(block.replace(".venv/bin/", f"{BIN}/"), tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    spec = model_spec_from_config(TINY)
    # The profile ran the model at its own shape (nothing narrowed, so nothing is scaled).
    header = json.loads((tmp_path / "prof.jsonl").read_text().splitlines()[0])
    assert header["model"]["name"] == "tiny-llama"
    shape = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab")
    assert {k: header["profiled"][k] for k in shape} == {k: getattr(spec, k) for k in shape}
    comm = [json.loads(line) for line in (tmp_path / "comm.jsonl").read_text().splitlines()]
    assert any(r.get("op") == "alltoall" and r.get("group_size") == 2 for r in comm), comm[:3]

    fitted = json.loads((tmp_path / "fitted.json").read_text())
    assert fitted["model"] == json.loads(spec.model_dump_json()) and fitted["hardware"] == "cpu"
    notes = fitted["notes"]
    assert "scaled to the full width" not in notes
    quality = fitted["fit_quality"]
    # Memory is measured exactly (the storages autograd saves): those terms pass on any load, so a
    # forced fit needs no memory margin; whatever is above 10% is named in the notes as FORCED.
    assert quality["activation_bytes"]["mape"] <= 0.10 and quality["peak_bytes"]["mape"] <= 0.10, quality
    poor = sorted(name for name, q in quality.items() if q["mape"] > 0.10)
    assert ("FORCED" in notes) == bool(poor), (poor, notes)
    for name in poor:
        assert name in notes

    out = result.stdout
    assert "dcp plan: text-longtail on cpu:2, 64 samples per step" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+[0-2]\s+[0-9.,]+\s+[0-9.]+%", line)]
    assert [r[0] for r in rows] == ["0", "1", "2"], out[-3000:]
    for r in rows:  # groups of the two CPU ranks: one group of 2, or two of 1
        assert r[-1] in ("2", "1x2"), r
    assert "BoundError" not in out + result.stderr
