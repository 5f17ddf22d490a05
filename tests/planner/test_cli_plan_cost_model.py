"""``dcp plan --cost-model FILE``: a fitted file plans on clusters of its hardware, and says what to
do on any other."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from costmodel.fit import FitConfig, fit_profiles
from costmodel.presets import load_model
from dcp_cli.main import app
from tests.costmodel.test_fit_synthetic import synthetic_profile


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_plan_with_a_fitted_cost_model(tmp_path: Path) -> None:
    path = tmp_path / "fitted.json"
    fit_profiles([synthetic_profile(load_model("llama-7b"), noise=0.0)],
                 FitConfig(model_id="fitted-llama-test")).file.save(path)
    runner = CliRunner()
    args = ["plan", "-w", "text-longtail", "-k", "1", "-b", "64", "--json", "--quiet", "--cost-model", str(path)]
    done = runner.invoke(app, [*args, "-c", "h200x32"])
    assert done.exit_code == 0, done.output
    row = json.loads(done.output)["steps"][0]
    assert row["step_time_s"] > 0 and row["num_samples"] == 64
    # another accelerator: refused with the way out
    done = runner.invoke(app, [*args, "-c", "h100x16"])
    assert done.exit_code != 0
    assert "describes hardware 'h200-sxm' but cluster 'h100x16' runs 'h100-sxm'" in _flat(done.output)
    assert "dcp fit --hardware h100-sxm" in _flat(done.output)
    # another model
    done = runner.invoke(app, ["plan", "-w", "video-short", "-c", "h200x32", "-k", "1", "--cost-model",
                               str(path)])
    assert done.exit_code != 0 and "is for model 'llama-7b'" in _flat(done.output)
    done = runner.invoke(app, [*args[:-1], str(tmp_path / "missing.json"), "-c", "h200x32"])
    assert done.exit_code != 0 and "--cost-model" in _flat(done.output)
