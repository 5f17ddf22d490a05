"""Regression of the reliability round (issue 24 item 7): a body's size in values is checked
before it is parsed (a body of 1e6 samples was parsed whole, ~12x its size in memory, before the
16,384-item limit refused it), and without a token one client has a bounded number of bodies in
the service at once (it could hold 64)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import COST_MODEL

pytestmark = pytest.mark.timeout(180)

MIB = 1024 * 1024


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_million_samples_are_refused_before_parsing(server_factory: Any) -> None:
    server = server_factory(token=None, env={"DCP_MAX_BODY_BYTES": str(64 * MIB)}).start()
    assert server.proc is not None
    samples = ",".join(f'{{"id":"s{i}","tokens":512}}' for i in range(1_000_000))
    body = f'{{"samples":[{samples}],"cluster":"h200x8","cost_model_id":"{COST_MODEL}"}}'.encode()
    before = _peak_rss_bytes(server.proc.pid)
    response = httpx.post(f"{server.url}/v1/plans", content=body, timeout=60.0,
                          headers={"Content-Type": "application/json"})
    grown = _peak_rss_bytes(server.proc.pid) - before
    assert response.status_code == 413 and "values" in response.text, response.text[:300]
    # The body is 29 MiB: read, joined, decoded and parsed up to the limit it took 124 MiB (4.3x;
    # parsed whole it was ~12x).
    assert grown < 6 * len(body), f"peak RSS grew {grown / MIB:.0f} MiB for a {len(body) / MIB:.0f} MiB body"
    assert httpx.get(f"{server.url}/healthz", timeout=10.0).status_code == 200


def test_one_client_holds_a_bounded_number_of_bodies(server_factory: Any) -> None:
    server = server_factory(token=None, env={"DCP_MAX_BODIES_PER_CLIENT": "3"}).start()
    head = (b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"samples\": [")
    held = []
    try:
        for _ in range(3):  # three slow bodies in flight
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(head)
            held.append(sock)
        time.sleep(0.5)
        refused = httpx.post(f"{server.url}/v1/plans", json={"samples": []}, timeout=10.0)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert httpx.get(f"{server.url}/v1/epochs", timeout=10.0).status_code == 200  # reads pass
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.post(f"{server.url}/v1/plans", json={"samples": []}, timeout=10.0).status_code == 429:
        assert time.monotonic() < deadline, "the slots were never given back"
        time.sleep(0.1)
