"""Stopping a real ``dcp serve`` the way a terminal or a service manager does: the signal goes
to the whole process group (Ctrl-C sends SIGINT to it, systemd and ``docker stop`` SIGTERM to
every process). The service stops its job, records the shutdown as the cause (not "a solver
worker died": the workers got the signal too), prints no traceback and no resource-tracker
warning (leaked semaphores), and the job resumes and finishes after a restart with the same
plans as an uninterrupted run."""

from __future__ import annotations

import os
import signal
import sqlite3
from typing import Any

import pytest

from .conftest import COST_MODEL, manifest_lines
from .test_server import _digests, _wait

pytestmark = pytest.mark.timeout(240)

STEPS = 24
PER_STEP = 16
# CP-SAT steps on 64 GPUs (~0.5-2 s each): the signal lands a moment after the first write, with
# about 20 steps, several seconds of the two workers' time, still to plan.
OPTIONS = {"time_limit_s": 2.0, "use_cpsat": True}


def _epoch(epoch_id: str) -> dict[str, Any]:
    return {"epoch_id": epoch_id, "manifest_jsonl": manifest_lines(PER_STEP * STEPS, seed=4),
            "batch": {"samples_per_step": PER_STEP}, "seed": 2, "cluster": "h200x64",
            "cost_model_id": COST_MODEL, "options": OPTIONS}


def _stored(server: Any, epoch_id: str) -> dict[str, Any]:
    conn = sqlite3.connect(server.tmp_path / "plans.sqlite")
    try:
        state, error = conn.execute("SELECT state, error FROM epochs WHERE id=?", (epoch_id,)).fetchone()
    finally:
        conn.close()
    return {"state": state, "error": error}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_group_signal_stops_cleanly_records_shutdown_and_resumes(server_factory: Any, sig: int) -> None:
    server = server_factory(workers=2).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("e")).status_code == 202
    before = _wait(server, "e", until=2)
    assert before["steps_done"] < STEPS, "too fast to interrupt; grow the epoch"
    os.killpg(server.proc.pid, sig)
    assert server.proc.wait(timeout=60) in (0, -sig), server.log.read_text()[-3000:]
    log = server.log.read_text()
    assert "planner service stopped" in log, log[-3000:]
    assert "leaked semaphore" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "worker died" not in log, log[-3000:]
    stored = _stored(server, "e")
    assert stored["state"] == "queued", stored
    assert stored["error"] is not None and "shut down" in stored["error"], stored

    again = server_factory(workers=2).start()
    status = _wait(again, "e")
    assert status["state"] == "done" and status["error"] is None, status
    assert again.request("POST", "/v1/epochs", json={**_epoch("ref")}).status_code == 202
    assert _wait(again, "ref")["state"] == "done"
    assert _digests(again, "e", STEPS) == _digests(again, "ref", STEPS)
