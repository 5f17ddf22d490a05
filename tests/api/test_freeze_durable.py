"""A step a rank has fetched stays frozen across a crash: the server is killed with SIGKILL right
after the fetch's answer arrives, restarted, and the store (and the service) still say the step is
frozen, so no recalibration can re-plan it under a rank that runs it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import AUTH, manifest_lines
from .test_reads_never_write import _stored_frozen_through
from .test_server import _epoch, _wait

pytestmark = pytest.mark.timeout(300)


def test_a_fetched_step_is_frozen_after_kill9_and_restart(server_factory: Any) -> None:
    server = server_factory().start()
    db = server.tmp_path / "plans.sqlite"
    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(24), 2)).status_code == 202
    assert _wait(server, "e")["state"] == "done"
    for step in (3, 7, 11):
        fetched = httpx.get(f"{server.url}/v1/epochs/e/steps/{step}/ranks/0", headers=AUTH, timeout=30.0)
        assert fetched.status_code == 200
        server.kill9()  # at once: nothing had time to flush anything
        assert _stored_frozen_through(db, "e") == step
        server = server_factory().start()
        assert server.request("GET", "/v1/epochs/e/recalibration").json()["frozen_through"] == step
