"""Slow request heads and connection floods against a real ``dcp serve`` on loopback (issue 24
item 10): a connection whose request head does not complete within
``DCP_REQUEST_HEAD_TIMEOUT_S`` is closed (uvicorn alone held 200 of them for 60 s, their head
trickling in a byte at a time); at ``DCP_MAX_CONNECTIONS`` a new connection closes the oldest one
that sent no request yet, or, when every one is busy, is answered 503 with ``Retry-After`` and
closed; the service answers normally throughout."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)

HEAD_TIMEOUT_S = 2.0


def _closed_by_server(sock: socket.socket) -> bool:
    """True when the server has closed the connection (EOF or reset) without an answer."""
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except BlockingIOError:
        return False


def test_slow_request_heads_are_closed(server_factory: Any) -> None:
    server = server_factory(token=None, env={"DCP_REQUEST_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S)}).start()
    socks = []
    idle = set()
    for i in range(100):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        if i % 4:  # most send the start of a head and then trickle, a quarter send nothing at all
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        else:
            idle.add(sock)
        sock.setblocking(False)
        socks.append(sock)
    start = time.monotonic()
    open_socks = list(socks)
    while open_socks and time.monotonic() - start < 10 * HEAD_TIMEOUT_S:
        still = []
        for sock in open_socks:
            try:
                if sock not in idle:
                    sock.send(b"X")  # one more byte of a header name: the head never completes
            except (BrokenPipeError, ConnectionResetError):
                continue
            if not _closed_by_server(sock):
                still.append(sock)
        open_socks = still
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        time.sleep(0.25)
    elapsed_s = time.monotonic() - start
    for sock in socks:
        sock.close()
    assert not open_socks, f"{len(open_socks)} of 100 slow connections still open after {elapsed_s:.1f} s"
    assert elapsed_s >= HEAD_TIMEOUT_S * 0.8, f"closed after {elapsed_s:.1f} s, before the head timeout"


def test_at_the_cap_the_oldest_idle_connection_makes_room_and_busy_ones_get_503(server_factory: Any) -> None:
    server = server_factory(token=None, env={"DCP_REQUEST_HEAD_TIMEOUT_S": "30", "DCP_MAX_CONNECTIONS": "20",
                                             "DCP_MAX_BODIES_PER_CLIENT": "64"}).start()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    time.sleep(0.5)  # the server has accepted them
    extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    extra.settimeout(5)
    held[0].settimeout(5)
    assert _closed_by_server(held[0])  # the oldest that sent nothing made room
    extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert b" 200 " in extra.recv(4096).split(b"\r\n", 1)[0] + b" "  # the newcomer is served
    extra.close()
    for sock in held[1:]:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b" 200 " in sock.recv(4096).split(b"\r\n", 1)[0] + b" "  # the others are served
        sock.close()
    # Twenty requests in flight (bodies still coming): none may be closed, a newcomer gets 503.
    busy = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    for sock in busy:
        sock.sendall(b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
    time.sleep(0.5)
    late = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    late.settimeout(5)
    answer = late.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower(), answer[:200]
    for sock in [late, *busy]:
        sock.close()
