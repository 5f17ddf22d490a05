"""Limits no single client, nor many addresses together, can exhaust, on a real ``dcp serve`` and
loopback addresses 127.0.0.3-6: bytes of request bodies in flight are capped service-wide (503 +
``Retry-After``), and connections per client address are capped, idle ones closed to make room,
so that a rank's authenticated fetch is served while one address holds many idle connections
(429 + ``Retry-After`` when its connections are all busy)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import AUTH, TOKEN, manifest_lines
from .test_server import _epoch, _wait

pytestmark = pytest.mark.timeout(240)


def _connect(port: int, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    return sock


@contextlib.contextmanager
def _held(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _slow_body(port: int, source: str, *, length: int, token: str | None = None) -> socket.socket:
    """A POST whose head and first bytes are sent, the rest of its ``length``-byte body never."""
    sock = _connect(port, source)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {length}\r\n\r\n{{\"samples\": [".encode())
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_body_bytes_in_flight_are_capped_across_addresses(server_factory: Any) -> None:
    # Bodies count at 3x their size: 2 x 900 kB (5.4 MB counted) fit in 6 MB, a third does not.
    server = server_factory(token=None, env={"DCP_MAX_BODY_BYTES_IN_FLIGHT": "6000000"}).start()
    with _held([_slow_body(server.port, f"127.0.0.{3 + i}", length=900_000) for i in range(2)]):
        time.sleep(0.5)  # both admitted
        late = _slow_body(server.port, "127.0.0.5", length=900_000)
        with _held([late]):
            late.settimeout(30)
            answer = late.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower(), answer[:300]
        assert b"DCP_MAX_BODY_BYTES_IN_FLIGHT" in answer
        small = httpx.post(f"{server.url}/v1/plans", json={"samples": []}, timeout=30.0)  # 14 bytes fit
        assert small.status_code == 422, small.text
        assert httpx.get(f"{server.url}/readyz", timeout=30.0).status_code == 200  # no body: never counted
    deadline = time.monotonic() + 30
    while _answer_within(_slow_body(server.port, "127.0.0.6", length=900_000), 1.0).startswith(b"HTTP/1.1 503"):
        assert time.monotonic() < deadline, "the bytes in flight were never given back"  # when the requests end


def _answer_within(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent within ``timeout_s`` (b"": nothing, the request waits for its body)."""
    with _held([sock]):
        sock.settimeout(timeout_s)
        try:
            return sock.recv(65536)
        except TimeoutError:
            return b""


def test_idle_connections_from_one_address_leave_rank_fetches_served(server_factory: Any) -> None:
    server = server_factory(env={"DCP_MAX_CONNECTIONS": "64", "DCP_MAX_CONNECTIONS_PER_CLIENT": "16",
                                 "DCP_REQUEST_HEAD_TIMEOUT_S": "60"}).start()
    assert server.request("POST", "/v1/epochs", json=_epoch("e", manifest_lines(16), 2)).status_code == 202
    assert _wait(server, "e")["state"] == "done"
    rank = httpx.HTTPTransport(local_address="127.0.0.3")
    with _held([_connect(server.port, "127.0.0.3") for _ in range(100)]) as idle, \
            httpx.Client(transport=rank, timeout=30.0) as same_address:
        time.sleep(0.5)
        # A rank on another address and one on the attacker's own are both answered.
        for step in range(8):
            assert httpx.get(f"{server.url}/v1/epochs/e/steps/{step}/ranks/0", headers=AUTH,
                             timeout=30.0).status_code == 200
            assert same_address.get(f"{server.url}/v1/epochs/e/steps/{step}/ranks/1",
                                    headers=AUTH).status_code == 200
        still_open = [s for s in idle if not _closed_by_server(s)]
        assert len(still_open) <= 16, len(still_open)


def test_an_address_whose_connections_are_all_busy_gets_429(server_factory: Any) -> None:
    server = server_factory(env={"DCP_MAX_CONNECTIONS_PER_CLIENT": "4"}).start()
    with _held([_slow_body(server.port, "127.0.0.4", length=1000, token=TOKEN) for _ in range(4)]):
        time.sleep(0.5)  # four requests in flight: none of them may be closed
        extra = _connect(server.port, "127.0.0.4")
        with _held([extra]):
            extra.settimeout(30)
            answer = extra.recv(65536)
        assert answer.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in answer.lower(), answer[:300]
        assert httpx.get(f"{server.url}/readyz", timeout=30.0).status_code == 200  # other addresses pass
