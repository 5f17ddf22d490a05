"""A request the app never answers is not counted as a 500 (found by bench/fuzz.py's raw phase).

A malformed chunk size makes uvicorn's HTTP layer answer 400 itself and end the body with a
disconnect; a client that sends half a body and hangs up does the same. The service answered no
5xx in either case, yet ``dcp_http_request_duration_seconds`` counted a 500 under route
``unmatched`` (its default status when no response started). Real ``dcp serve`` on loopback,
raw sockets.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def _counts_by_status(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "dcp_http_request_duration_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    status = sample.labels["status"]
                    counts[status] = counts.get(status, 0) + int(sample.value)
    return counts


def _raw(port: int, data: bytes, *, hang_up: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        if hang_up:
            return b""
        reply = b""
        while b"\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        return reply


def test_malformed_chunk_and_hang_up_are_not_counted_as_500(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory(token=None).start()
    head = (b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    reply = _raw(server.port, head + b"zz\r\nabc\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400"), reply  # what the client saw
    _raw(server.port, b"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"samples\": [", hang_up=True)
    # the hang-up is noticed by the server in its own time: poll the counters for it
    deadline = time.monotonic() + 20
    while True:
        counts = _counts_by_status(server.request("GET", "/metrics").text)
        if counts.get("499", 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counts.get("500", 0) == 0, counts  # (503s are /readyz's start-up polls)
    assert counts.get("499") == 2, counts
