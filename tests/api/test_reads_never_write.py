"""A rank's fetch never waits long on a store locked by another process: new steps are still
served (they were 503 when the first fetch had to freeze the step in SQLite), frozen in memory
and written once the lock is gone (api/revisions_store.py); with a token set, a fetch without it
freezes nothing."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import httpx
import pytest

from .conftest import AUTH, manifest_lines
from .test_faults import hold_lock, release_lock
from .test_server import _epoch, _wait

pytestmark = pytest.mark.timeout(180)


def _stored_frozen_through(db: Any, epoch_id: str) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT frozen_through FROM epoch_recalibration WHERE epoch_id=?",
                           (epoch_id,)).fetchone()
    finally:
        conn.close()
    return -1 if row is None else int(row[0])


def test_rank_fetches_are_served_from_a_locked_store_and_write_nothing(server_factory: Any) -> None:
    server = server_factory(env={"DCP_STORE_BUSY_TIMEOUT_S": "1.0"}).start()
    db = server.tmp_path / "plans.sqlite"
    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(16), 2)).status_code == 202
    assert _wait(server, "e")["state"] == "done"
    holder = hold_lock(db, None)  # held until released: every fetch below runs under the lock
    try:
        codes = [server.request("GET", f"/v1/epochs/e/steps/{s}/ranks/0").status_code for s in range(8)]
        # none waited on the lock: a fetch that needed it would fail after the store's 1 s busy timeout
        assert codes == [200] * 8, codes
        assert holder.poll() is None  # still held
    finally:
        release_lock(holder)
    deadline = time.monotonic() + 10
    while _stored_frozen_through(db, "e") < 7:  # persisted after the lock, by the flusher
        assert time.monotonic() < deadline, _stored_frozen_through(db, "e")
        time.sleep(0.1)


def test_only_a_fetch_with_the_token_freezes(server_factory: Any) -> None:
    server = server_factory().start()
    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(16), 2)).status_code == 202
    assert _wait(server, "e")["state"] == "done"
    anonymous = httpx.get(f"{server.url}/v1/epochs/e/steps/7/ranks/0", timeout=10.0)
    assert anonymous.status_code in (200, 401)
    assert server.request("GET", "/v1/epochs/e/recalibration").json()["frozen_through"] == -1
    assert httpx.get(f"{server.url}/v1/epochs/e/steps/3/ranks/0", headers=AUTH, timeout=10.0).status_code == 200
    assert server.request("GET", "/v1/epochs/e/recalibration").json()["frozen_through"] == 3
