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


def test_ctrl_c_says_the_epoch_was_interrupted_and_how_to_resume(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) once a step is stored: exit 130 with a line naming the steps kept and how to
    go on (it used to exit 130 with nothing said); the same command then finishes the epoch."""
    import contextlib
    import os
    import signal
    import sqlite3
    import time

    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_lines(4000))  # 400 steps: far more than are planned before the signal
    out = tmp_path / "plans.sqlite"
    options = [arg for key, value in FAST.items() if key != "time_limit_s"
               for arg in ("--option", f"{key}={json.dumps(value)}")]
    cmd = [sys.executable, "-m", "dcp_cli.main", "epoch", str(manifest), "--cluster", "h200x8",
           "--cost-model", COST_MODEL, "--out", str(out), "--samples-per-step", "10", "--seed", "4",
           "--time-limit-s", str(FAST["time_limit_s"]), "--workers", "1", "--quiet", *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stored() -> int:
        if not out.exists():
            return 0
        with contextlib.closing(sqlite3.connect(out, timeout=30)) as conn:
            try:
                return int(conn.execute("SELECT COUNT(*) FROM plans").fetchone()[0])
            except sqlite3.OperationalError:  # the schema is not there yet
                return 0

    try:
        while proc.poll() is None and stored() == 0:  # judged by work: the first stored step
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: epoch m-s4 stopped with" in err and "/400 steps stored in" in err, err
    assert "run the same command again to resume" in err and "Traceback" not in err, err
    kept = stored()
    assert 0 < kept < 400
    resumed = subprocess.run([*cmd, "--max-steps", "2"], capture_output=True, text=True, timeout=100, check=False)
    assert resumed.returncode == 0, resumed.stderr
    assert stored() == kept + 2
