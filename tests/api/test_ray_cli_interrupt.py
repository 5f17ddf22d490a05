"""``dcp epoch --ray-address`` whose local raylet dies mid-epoch (issue 24 item 12): Ray's core
worker ends the driver from C++, so before ``dcp_cli/ray_supervisor.py`` the command exited 1
with nothing on stderr and left the epoch ``running`` in its store. Now it says how to resume,
the store marks the epoch interrupted (``queued``, the cause in ``error``) with its steps kept,
and the same command without Ray finishes it. One single-node Ray cluster on this machine."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import COST_MODEL, FAST, manifest_lines, ray_environ

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(240)

NUM_SAMPLES = 384
"""48 steps: the raylet dies once 4 are stored, with tens still to plan."""
SAMPLES_PER_STEP = 8
NUM_STEPS = NUM_SAMPLES // SAMPLES_PER_STEP
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _epoch_cmd(manifest: Path, db: Path, *extra: str) -> list[str]:
    options = [a for k, v in FAST.items() if k != "time_limit_s" for a in ("--option", f"{k}={str(v).lower()}")]
    return [sys.executable, "-m", "dcp_cli.main", "epoch", str(manifest), "--cluster", "h200x8",
            "--cost-model", COST_MODEL, "--out", str(db), "--samples-per-step", str(SAMPLES_PER_STEP),
            "--seed", "7", "--time-limit-s", str(FAST["time_limit_s"]), "--epoch-id", "e", "--quiet",
            *options, *extra]


def _stored(db: Path) -> tuple[str, str | None, int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        state, error = conn.execute("SELECT state, error FROM epochs WHERE id='e'").fetchone()
        (num_plans,) = conn.execute("SELECT COUNT(*) FROM plans WHERE epoch_id='e'").fetchone()
    return state, error, num_plans


def test_lost_local_raylet_ends_dcp_epoch_with_a_resume_message(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_lines(NUM_SAMPLES))
    db = tmp_path / "e.sqlite"
    with ray_environ(RAY_ENV):
        env = {**os.environ}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            driver = subprocess.Popen(_epoch_cmd(manifest, db, "--ray-address", cluster.address,
                                                 "--ray-steps-per-task", "2"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
            deadline = time.monotonic() + 120
            stored = 0
            while driver.poll() is None and time.monotonic() < deadline and stored < 4:
                with contextlib.suppress(sqlite3.Error, TypeError):
                    stored = _stored(db)[2] if db.exists() else 0
                time.sleep(0.05)
            assert driver.poll() is None and stored >= 4, (stored, driver.poll())
            raylets = [p.process.pid for node in cluster.list_all_nodes()
                       for kind, processes in node.all_processes.items() if kind == "raylet" for p in processes]
            assert raylets
            for pid in raylets:  # the driver's local raylet (the only node)
                os.kill(pid, signal.SIGKILL)
            _, err = driver.communicate(timeout=120)
        finally:
            with contextlib.suppress(Exception):
                cluster.shutdown()
    message = " ".join(err.decode(errors="replace").split())
    assert driver.returncode != 0, message[-2000:]
    assert "run the same command again to resume" in message, message[-2000:]
    state, error, num_plans = _stored(db)
    assert state == "queued", (state, error)
    assert error is not None and error.startswith("interrupted") and "raylet" in error, error
    assert 4 <= num_plans < NUM_STEPS

    again = subprocess.run(_epoch_cmd(manifest, db, "--workers", "1"), capture_output=True, text=True,
                           timeout=200, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"done, {NUM_STEPS}/{NUM_STEPS} steps" in again.stdout, again.stdout
    assert _stored(db) == ("done", None, NUM_STEPS)
