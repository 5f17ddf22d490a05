"""A job's status tells a store fault while it lasts (issue 24 item 11), through a real
``dcp serve``: another process holds the store's write lock (reads still work: WAL), so the
job's writes fail and so would any record of the failure; the status names the cause, says the
job is queued and when it retries, and the job finishes once the lock is gone with the plans of
an undisturbed run. Before, the status said ``running`` with ``error: null`` all along."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

from .conftest import COST_MODEL, manifest_lines
from .test_server import _digests, _wait

pytestmark = pytest.mark.timeout(240)

STEPS = 24
"""Enough that the job is mid-epoch when the lock is taken (the lock is taken a moment after the
first write and held until the status has named it, so the job cannot finish while it lasts)."""
PER_STEP = 16
OPTIONS = {"time_limit_s": 2.0, "use_cpsat": True}

WRITE_LOCK_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
print("ready", flush=True)
sys.stdin.readline()
conn.execute("BEGIN IMMEDIATE")  # the write lock; WAL readers go on
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""
"""Another process: takes the store's write lock on the first line on its stdin, commits on the
second (started ahead, so the lock lands a moment after the job's progress is seen)."""


def _epoch(epoch_id: str) -> dict[str, Any]:
    return {"epoch_id": epoch_id, "manifest_jsonl": manifest_lines(PER_STEP * STEPS, seed=6),
            "batch": {"samples_per_step": PER_STEP}, "seed": 3, "cluster": "h200x64",
            "cost_model_id": COST_MODEL, "options": OPTIONS}


def test_status_names_a_store_that_cannot_be_written(server_factory: Any) -> None:
    server = server_factory(workers=2, env={"DCP_STORE_BUSY_TIMEOUT_S": "0.3"}).start()
    holder = subprocess.Popen([sys.executable, "-c", WRITE_LOCK_HOLDER, str(server.tmp_path / "plans.sqlite")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    assert holder.stdout.readline().strip() == "ready"
    assert server.request("POST", "/v1/epochs", json=_epoch("e")).status_code == 202
    before = _wait(server, "e", until=2)
    assert before["steps_done"] < STEPS, "too fast to interrupt; grow the epoch"
    holder.stdin.write("lock\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "locked"
    # The lock lasts until the status has named the fault with a retry to come, or until the
    # server has logged three failed tries of the job under it (the status should have named the
    # fault long before: then the assertions below say what it showed instead).
    seen: list[dict[str, Any]] = []
    while not any(s["error"] is not None and s["retry_in_s"] for s in seen) and \
            server.log.read_text().count("epoch e: transient failure") < 3:
        response = server.request("GET", "/v1/epochs/e")
        assert response.status_code == 200, response.text  # reads go on under a write lock
        seen.append(response.json())
        time.sleep(0.1)
    holder.stdin.write("release\n")
    holder.stdin.flush()
    assert holder.wait(timeout=60) == 0
    degraded = [s for s in seen if s["error"] is not None]
    assert degraded, f"the status never named the fault: {[(s['state'], s['error']) for s in seen[-3:]]}"
    last = degraded[-1]
    assert "locked" in last["error"], last
    assert last["state"] == "queued" and last["transient"] and last["attempts"] >= 1, last
    assert last["retry_in_s"] is not None and last["retry_in_s"] >= 0, last
    assert any(s["retry_in_s"] and s["retry_in_s"] > 0 for s in degraded), degraded[-3:]

    final = _wait(server, "e")
    assert final["state"] == "done" and final["error"] is None and final["retry_in_s"] is None, final
    assert server.request("POST", "/v1/epochs", json=_epoch("ref")).status_code == 202
    assert _wait(server, "ref")["state"] == "done"
    assert _digests(server, "e", STEPS) == _digests(server, "ref", STEPS)
