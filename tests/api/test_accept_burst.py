"""A burst of connections opened while the event loop is busy is accepted at once (issue 24's
rank-view tail: uvloop's libuv accepts one connection per loop iteration, so under load the last
of 256 new connections waited 2.3 s in the kernel's accept queue; api/http_guard.py).

The server is uvicorn with ``dcp serve``'s own connection settings (``server_options``: the
guarded protocol, backlog, event loop) on loopback. A task in the app blocks the loop for
``BLOCK_S`` on every iteration, as serving many busy connections does, and counts the iterations;
32 connections are then opened at once and each sends one request. Judged in loop iterations, not
seconds: accepting them all in one iteration answers the last within a few iterations of the
burst; one accept per iteration (uvloop) needs at least 32.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest
import uvicorn

from api.http_guard import CoalescingTransport, server_options
from dcp_cli.net import free_port

BLOCK_S = 0.02
BURST = 32


class Iterations:
    """The loop iterations the blocking task has seen, and the count at which each "/" request
    was answered (both written on the loop only)."""

    def __init__(self) -> None:
        self.count = 0
        self.answered_at: list[int] = []


def _app(iterations: Iterations) -> Any:
    """A minimal ASGI app whose lifespan starts a task that blocks the loop on every iteration."""
    busy: list[asyncio.Task[None]] = []

    async def spin() -> None:
        while True:
            time.sleep(BLOCK_S)  # blocking the loop is the point
            iterations.count += 1
            await asyncio.sleep(0)  # one step per loop iteration

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    for task in busy:
                        task.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/spin" and not busy:
            busy.append(asyncio.get_running_loop().create_task(spin()))
        elif scope["path"] == "/":
            iterations.answered_at.append(iterations.count)
        body = b"ok"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


def _get(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode())
    data = b""
    while not data.endswith(b"ok"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture()
def busy_server() -> Any:
    """(port, iterations) of the busy app served in a thread of this process."""
    port = free_port()
    iterations = Iterations()
    config = uvicorn.Config(_app(iterations), host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            **server_options(head_timeout_s=30.0, max_connections=2048))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield port, iterations
    server.should_exit = True
    thread.join(timeout=20)


def test_burst_of_connections_is_accepted_in_one_iteration(busy_server: tuple[int, Iterations]) -> None:
    port, iterations = busy_server
    with socket.create_connection(("127.0.0.1", port)) as first:
        assert _get(first, "/spin").startswith(b"HTTP/1.1 200")  # the loop blocks from now on
        burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(BURST)]
        try:
            for sock in burst:
                sock.sendall(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
            sent_at = iterations.count  # every connection is open and its request sent
            for sock in burst:
                data = b""
                while not data.endswith(b"ok"):
                    chunk = sock.recv(4096)
                    assert chunk, "connection closed before the answer"
                    data += chunk
                assert data.startswith(b"HTTP/1.1 200")
        finally:
            for sock in burst:
                sock.close()
    assert len(iterations.answered_at) == BURST
    # One accept per iteration: the last answered >= BURST iterations after the requests were
    # sent (fewer only for those accepted while they were being opened). All at once: a few.
    assert max(iterations.answered_at) - sent_at < BURST / 2, (
        f"the last of {BURST} new connections was answered {max(iterations.answered_at) - sent_at} loop "
        f"iterations after the burst was sent: connections are accepted one per iteration")


async def _read_to_end(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """Everything the peer sends on ``sock`` until it closes (or resets); closes ``sock``."""
    received = b""
    while True:
        try:
            chunk = await loop.sock_recv(sock, 4096)
        except ConnectionError:
            break
        if not chunk:
            break
        received += chunk
    sock.close()
    return received

def test_coalescing_transport_writes_a_response_once_in_order() -> None:
    async def scenario() -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        b.setblocking(False)
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=a)
        writes: list[int] = []
        real_write = transport.write

        def counting_write(data: bytes) -> None:
            writes.append(len(data))
            real_write(data)

        transport.write = counting_write  # type: ignore[method-assign]
        wrapped = CoalescingTransport(transport, loop)  # type: ignore[arg-type]
        wrapped.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        wrapped.write(b"")
        wrapped.write(b"body")
        assert writes == [] and wrapped.get_write_buffer_size() == 42
        await asyncio.sleep(0)  # the end of this callback: one write
        wrapped.write(b"tail")
        wrapped.close()  # what is held is written before the close
        received = await _read_to_end(loop, b)
        return received, writes

    received, writes = asyncio.run(scenario())
    assert received == b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbodytail"
    assert writes == [42, 4]


def test_coalescing_transport_abort_drops_what_is_held() -> None:
    async def scenario() -> bytes:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        b.setblocking(False)
        transport, _ = await loop.create_connection(asyncio.Protocol, sock=a)
        wrapped = CoalescingTransport(transport, loop)  # type: ignore[arg-type]
        wrapped.write(b"never sent")
        wrapped.abort()
        await asyncio.sleep(0)
        received = await _read_to_end(loop, b)
        return received

    assert asyncio.run(scenario()) == b""
