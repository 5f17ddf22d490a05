"""``dcp fit``: a profile of a plausible peak structure fits without --force; a forced fit prints its
margin beside the safety fraction (the larger kept free, never both) and what they cost in step
time on a preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from costmodel.presets import load_model
from costmodel.profiling.format import write_profile
from costmodel.schema import CostModelFile
from dcp_cli.main import app
from tests.costmodel.test_fit_synthetic import _quadratic_peaks, synthetic_profile

pytestmark = pytest.mark.timeout(240)
runner = CliRunner(env={"COLUMNS": "250"})


def _json(output: str) -> dict:  # type: ignore[type-arg]
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def _write(path: Path, structure: str = "is_transient", quadratic: bool = False) -> Path:
    profile = synthetic_profile(load_model("llama-7b"), noise=0.01, seed=4, structure=structure)
    if quadratic:
        profile = _quadratic_peaks(profile)
    write_profile(path, profile.header, [*profile.compute, *profile.head, *profile.comm])
    return path


def test_fit_accepts_the_transient_being_the_recomputed_layer_without_force(tmp_path: Path) -> None:
    out = tmp_path / "cm.json"
    result = runner.invoke(app, ["fit", str(_write(tmp_path / "p.jsonl")), "--out", str(out), "--json",
                                 "--price-on", "none"])
    assert result.exit_code == 0, result.output
    payload = _json(result.output)
    assert payload["peak_bytes"]["mape"] <= 0.05
    assert payload["memory_reserve"] == {"margin": 0.0, "safety_fraction": 0.05, "reserved_fraction": 0.05,
                                         "priced": None}
    assert "the transient is the recomputed layer" in CostModelFile.load(out).notes


def test_forced_fit_prints_its_margin_the_safety_fraction_and_their_step_time(tmp_path: Path) -> None:
    out, path = tmp_path / "cm.json", _write(tmp_path / "q.jsonl", quadratic=True)
    refused = runner.invoke(app, ["fit", str(path), "--out", str(out)])
    assert refused.exit_code == 1 and "model-form error" in refused.output and not out.exists()
    result = runner.invoke(app, ["fit", str(path), "--out", str(out), "--force", "--price-on", "text-longtail@h200x8",
                                 "--json"])
    assert result.exit_code == 0, result.output
    reserve = _json(result.output)["memory_reserve"]
    margin = CostModelFile.load(out).activation.memory_margin_fraction
    assert reserve["margin"] == pytest.approx(margin) and margin > 0.05
    assert reserve["reserved_fraction"] == pytest.approx(max(0.05, margin / (1 + margin)))
    priced = reserve["priced"]
    assert (priced["workload"], priced["cluster"]) == ("text-longtail", "h200x8")
    assert list(priced["step_time_s"]) == ["nothing kept free", "safety fraction 0.050",
                                           f"reserve {reserve['reserved_fraction']:.3f} (this file)"]
    assert all(t is not None and t > 0 for t in priced["step_time_s"].values())
    table = runner.invoke(app, ["fit", str(path), "--out", str(out), "--force", "--price-on", "text-longtail@h200x8"])
    text = " ".join(table.output.split())
    assert table.exit_code == 0 and f"margin {margin:.1%}" in text and "safety fraction 5.0%" in text, text
    assert "vs nothing kept free" in text
    bad = runner.invoke(app, ["fit", str(path), "--out", str(out), "--force", "--price-on", "text-longtail"])
    assert bad.exit_code == 2 and "WORKLOAD@CLUSTER" in bad.output
