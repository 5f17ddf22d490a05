"""``dcp epoch``: offline precompute into a store the service serves; stop and resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from costmodel.presets import default_cost_model_file, load_cluster
from planner.epoch import BatchRule, StepTask, make_steps, plan_step
from planner.workload import read_manifest

from .conftest import COST_MODEL, FAST, manifest_lines

pytestmark = pytest.mark.timeout(120)


def _dcp_epoch(manifest: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    options = [arg for key, value in FAST.items() if key != "time_limit_s"
               for arg in ("--option", f"{key}={json.dumps(value)}")]
    return subprocess.run(
        [sys.executable, "-m", "dcp_cli.main", "epoch", str(manifest), "--cluster", "h200x8",
         "--cost-model", COST_MODEL, "--out", str(out), "--samples-per-step", "10", "--seed", "4",
         "--time-limit-s", str(FAST["time_limit_s"]), "--workers", "1", *options, *extra],
        capture_output=True, text=True, timeout=100, check=False)


def test_offline_epoch_resumes_and_is_served(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_lines(60))
    out = tmp_path / "plans.sqlite"
    first = _dcp_epoch(manifest, out, "--max-steps", "2")
    assert first.returncode == 0, first.stderr
    assert "queued" in first.stdout
    second = _dcp_epoch(manifest, out)
    assert second.returncode == 0, second.stderr
    assert "done, 6/6 steps" in second.stdout
    other = _dcp_epoch(manifest, out, "--seed", "5", "--epoch-id", "m-s4")
    assert other.returncode != 0 and "other inputs" in other.stderr

    # The same step planned in this process gives the same bytes.
    steps = make_steps(read_manifest(manifest), rule=BatchRule(samples_per_step=10), seed=4)
    expected = plan_step(StepTask.create(step=3, samples=steps[3], cluster=load_cluster("h200x8"),
                                         cost_model=default_cost_model_file("llama-7b", "h200-sxm"),
                                         options=FAST, seed=4))

    settings = Settings(db_path=out, data_dir=tmp_path, num_workers=1)
    with TestClient(create_app(settings)) as client:
        status = client.get("/v1/epochs/m-s4").json()
        assert status["state"] == "done" and status["steps_done"] == 6
        data = client.get("/v1/epochs/m-s4/steps/3").json()
        assert data["digest"] == expected.digest
        assert json.loads(expected.plan_json) == data["plan"]
        assert client.get("/v1/epochs/m-s4/steps/3/ranks/5").json()["plan_digest"] == expected.digest
