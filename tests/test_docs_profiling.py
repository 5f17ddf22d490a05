"""docs/profiling.md runs top to bottom as written (``tests/doc_blocks.py``): its CPU quick tour
profiles a small Llama config at its own shape on the CPU, fits it, and plans on ``cpu:2`` with the
fitted file. The files it writes and the plan it prints are checked; that a fitted file plans only
the model it was fitted for is tested in tests/planner/test_cli_plan_cost_model.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from costmodel.model_config import model_spec_from_config
from tests.doc_blocks import ROOT, not_ignored, run_page, session, written

TINY = ROOT / "examples" / "tiny-llama"

pytestmark = pytest.mark.timeout(400)


def test_the_profiling_page_runs_top_to_bottom(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # dcp profile, torchrun
    page = ROOT / "docs" / "profiling.md"
    for step in ("dcp profile", "profile-comm", "dcp fit", "dcp plan"):
        assert step in session(page)
    result = run_page(page, tmp_path, timeout_s=380)
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
    for r in rows:  # groups of the two CPU ranks: one group of 2 (Ulysses or, under the default
        # layout=auto, a ring, followed by what it saves), or two of 1
        groups = re.split(r"\s*\(saves", " ".join(r))[0].split()[-1]
        assert groups in ("2", "1x2", "2[1*2]"), r
    assert "BoundError" not in out + result.stderr
    assert not_ignored(written(tmp_path)) == [], "the page's commands write files git does not ignore"
