"""``dcp plan --cost-model FILE``: a fitted file plans on clusters of its hardware, and says what to
do on any other."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from costmodel.analytic import analytic_cost_model
from costmodel.fit import FitConfig, fit_profiles
from costmodel.model_config import model_spec_from_config
from costmodel.presets import cpu_cluster, load_model
from dcp_cli.main import app
from tests.costmodel.test_fit_synthetic import synthetic_profile

ROOT = Path(__file__).resolve().parents[2]


def _flat(text: str) -> str:
    return " ".join(text.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


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


def test_a_file_for_another_model_plans_when_that_model_is_named(tmp_path: Path) -> None:
    """A file for a small model (docs/profiling.md's CPU tour fits one for examples/tiny-llama) plans a
    workload preset's samples when ``--model-config`` / ``--model`` names that model; a file for
    another model than the one named is refused naming both shapes (exit 2)."""
    tiny = ROOT / "examples" / "tiny-llama"
    path = tmp_path / "tiny.json"
    analytic_cost_model(model_spec_from_config(tiny), cpu_cluster(2).hardware).save(path)
    runner = CliRunner()
    args = ["plan", "-w", "text-longtail", "-c", "cpu:2", "-k", "1", "-b", "8", "--quiet", "--cost-model", str(path)]
    done = runner.invoke(app, [*args, "--model-config", str(tiny), "--json"])
    assert done.exit_code == 0, done.output
    row = json.loads(done.output)["steps"][0]
    assert row["num_samples"] == 8 and sum(row["group_sizes"]) == 2
    done = runner.invoke(app, [*args, "--model", "llama-7b"])
    assert done.exit_code == 2, done.output
    assert ("cost model 'analytic-tiny-llama-cpu' is for model 'tiny-llama' (2 layers, hidden 128, 4/2 heads, "
            "ffn 344), --model / --model-config names 'llama-7b' (32 layers, hidden 4096, 32/32 heads, "
            "ffn 11008)") in _flat(done.output)
    done = runner.invoke(app, args)  # no model named: the workload's llama-7b, and the way out
    assert done.exit_code == 2 and "workload 'text-longtail' trains 'llama-7b'" in _flat(done.output)
    assert "name 'tiny-llama' with --model / --model-config" in _flat(done.output)
