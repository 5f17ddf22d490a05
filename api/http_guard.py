"""Connection-level limits uvicorn does not have: a deadline on each request head, and caps on
open connections, in all and per client address (:class:`ConnectionTable`).

uvicorn (0.55) arms no timer on a new connection and disarms its keep-alive timer on every byte
received, so a client that sends a request head a byte at a time, or nothing at all, holds its
connection (and a file descriptor) for good: 200 of them stayed open for 60 s (issue 24). Its
``limit_concurrency`` answers 503 past the limit but still accepts and keeps the connections.

:func:`guarded_protocol` makes uvicorn's httptools protocol class (httptools is a dependency of
the service) with both limits: a connection whose request head (request
line and headers, up to the blank line) is not complete ``head_timeout_s`` after the connection
opened or after its previous response, is closed; a connection accepted while ``max_connections``
are open is closed at once. Bodies have their own deadline (``api.limits``).

:func:`server_options` is everything ``dcp serve`` passes to uvicorn about connections: that
protocol, the listen backlog, and the event loop, which is asyncio's, not uvloop's. uvloop (0.23
here) runs libuv, which since libuv 1.45 accepts one connection per event-loop iteration
(libuv/libuv pull request 3696, "unix: don't accept() connections in a loop"). Under load an
iteration serves every ready connection (15-20 ms at 256 busy connections on 2 cores), so a
burst of new connections waits in the kernel's accept queue, one accepted per iteration: with
``wrk -c 256`` (bench/load_rankview.py) 113 connections sat in the queue at 0.2 s and the last
was accepted 2.3 s after the start, and the fetches sent on them were answered that late (p99
1.0-1.6 s while the server handled every request it had read in under 60 ms). asyncio's selector
loop accepts up to ``backlog`` connections per iteration (``_accept_connection``): all 256 within
30 ms, p99 35 ms. The rest of the service is the same code on either loop.

The protocol also sends each response in one ``send`` system call: uvicorn writes the status line
and headers, then the body, each straight to the socket, and under wrk those two writes were 28%
of the service's CPU (py-spy). :class:`CoalescingTransport` holds what is written in one task
step and writes it at the end of that event-loop callback (``call_soon``), so a response written
head then body leaves in one segment; a streamed response's parts still leave as they come.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

logger = logging.getLogger(__name__)


class CoalescingTransport:
    """A transport that joins the writes made in one event-loop callback into one socket write.

    The first ``write`` after a flush schedules the flush (``loop.call_soon``); later writes
    before it only append. ``close`` and ``write_eof`` write what is held first; ``abort`` drops
    it. ``get_write_buffer_size`` counts it. Everything else is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hold ``data`` until the end of this event-loop callback."""
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def flush(self) -> None:
        """Write what is held, in one call."""
        if self._held:
            data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        """Hold each chunk (``write``)."""
        for chunk in chunks:
            self.write(chunk)

    def close(self) -> None:
        """Write what is held, then close (the transport sends its buffer first)."""
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        """Write what is held, then half-close."""
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        """Drop what is held and close at once."""
        self._held.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        """Bytes held here and in the transport's buffer."""
        return sum(map(len, self._held)) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


EVENT_LOOP = "asyncio"
"""uvicorn's ``loop`` setting for ``dcp serve``: asyncio's selector loop, which accepts a burst of
connections in one iteration (module docstring; uvloop's libuv accepts one per iteration)."""


def server_options(*, head_timeout_s: float, max_connections: int,
                   max_connections_per_client: int | None = None) -> dict[str, Any]:
    """uvicorn's connection settings for ``dcp serve`` (``uvicorn.run(app, **server_options(...))``
    or ``uvicorn.Config``): the guarded protocol, a listen backlog of ``max_connections`` (at most
    2,048), and the asyncio event loop (:data:`EVENT_LOOP`).

    Args:
        head_timeout_s: Seconds a request head may take to arrive (:func:`guarded_protocol`).
        max_connections: Open connections at most (:func:`guarded_protocol`).
        max_connections_per_client: Open connections of one client address at most (None: half
            of ``max_connections``).

    Raises:
        ValueError: for a non-positive timeout or cap.
    """
    return {"http": guarded_protocol(head_timeout_s=head_timeout_s, max_connections=max_connections,
                                     max_connections_per_client=max_connections_per_client),
            "backlog": min(max_connections, 2048), "loop": EVENT_LOOP}


def refusal(status: int, reason: str) -> bytes:
    """A whole HTTP response refusing a connection: JSON ``{"detail": reason}``, ``Retry-After: 1``,
    ``Connection: close``."""
    phrase = {429: "Too Many Requests", 503: "Service Unavailable"}[status]
    body = json.dumps({"detail": reason}).encode()
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
            "\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionTable:
    """Open connections by client address, and which of them have not sent a request head yet
    (the only ones that may be closed to make room: they cost the client nothing to open again,
    and an attacker's idle connections are all of this kind)."""

    def __init__(self, *, max_connections: int, max_per_client: int) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.total = 0
        self.by_client: dict[str, int] = {}
        self.fresh: dict[str, dict[Any, None]] = {}
        """Per client, its connections without a request head yet, oldest first."""

    def admit(self, client: str, conn: Any) -> tuple[int, str] | None:
        """Count ``conn`` in, closing the oldest fresh connection of ``client`` (or of the client
        with the most) when a cap is reached; the refusal ``(status, reason)`` when none can go."""
        if self.by_client.get(client, 0) >= self.max_per_client and not self._evict(client):
            return 429, (f"more than {self.max_per_client} open connections from this address "
                         "(DCP_MAX_CONNECTIONS_PER_CLIENT)")
        if self.total >= self.max_connections and not self._evict(None):
            return 503, f"{self.max_connections} connections open already (DCP_MAX_CONNECTIONS)"
        self.total += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        self.fresh.setdefault(client, {})[conn] = None
        return None

    def head_arrived(self, client: str, conn: Any) -> None:
        """``conn`` sent a request head: it is never closed to make room."""
        queue = self.fresh.get(client)
        if queue is not None:
            queue.pop(conn, None)
            if not queue:
                del self.fresh[client]

    def release(self, client: str, conn: Any) -> None:
        """``conn`` is gone (closed by either side, or evicted)."""
        self.head_arrived(client, conn)
        self.total -= 1
        left = self.by_client[client] - 1
        if left:
            self.by_client[client] = left
        else:
            del self.by_client[client]

    def _evict(self, client: str | None) -> bool:
        if client is None:
            if not self.fresh:
                return False
            client = max(self.fresh, key=lambda c: len(self.fresh[c]))
        queue = self.fresh.get(client)
        if not queue:
            return False
        victim = next(iter(queue))
        self.release(client, victim)
        victim.evict()
        return True


def guarded_protocol(*, head_timeout_s: float, max_connections: int,
                     max_connections_per_client: int | None = None) -> type[Any]:
    """A uvicorn HTTP protocol class (pass it as ``uvicorn.run(..., http=...)``) with a request
    head deadline, caps on open connections (in all and per client address), and one socket write
    per response (:class:`CoalescingTransport`).

    At a cap, a new connection makes room by closing the oldest connection that has not sent a
    request head yet (of its own address at the per-address cap, else of the address with the
    most): 2,500 connections from one address that send nothing take at most its share of the
    slots, and a rank that connects and asks for its plan is served. When no such connection is
    left, the new one is answered 429 (its address's cap) or 503 (the service's), both with
    ``Retry-After``, and closed.

    Args:
        head_timeout_s: Seconds a request head may take to arrive, from the connection's start or
            the end of its previous response.
        max_connections: Open connections at most.
        max_connections_per_client: Open connections of one client address at most (None: half
            of ``max_connections``).

    Raises:
        ValueError: for a non-positive timeout or cap.
    """
    if not head_timeout_s > 0:
        raise ValueError(f"head_timeout_s must be positive, got {head_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    per_client = max_connections_per_client or max(1, max_connections // 2)
    if per_client < 1:
        raise ValueError(f"max_connections_per_client must be at least 1, got {per_client}")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools: a dependency

    table = ConnectionTable(max_connections=max_connections, max_per_client=per_client)

    class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """uvicorn's protocol with a head deadline and connection caps (module docstring)."""

        _head_timer: asyncio.TimerHandle | None = None
        _client_key: str | None = None
        connection_table = table

        def connection_made(self, transport: Any) -> None:
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if peer else "unknown"
            refused = table.admit(client, self)
            if refused is not None:
                status, reason = refused
                logger.warning("connection from %s refused: %s", client, reason)
                transport.write(refusal(status, reason))
                transport.close()
                return
            self._client_key = client
            # duck-typed: it has every method uvicorn's protocol calls on a transport
            super().connection_made(cast(asyncio.Transport, CoalescingTransport(transport, self.loop)))
            self._arm_head_timer()

        def evict(self) -> None:
            """Closed to make room (it sent no request head): already uncounted."""
            logger.info("closing an idle connection from %s to make room", self._client_key)
            self._client_key = None
            self._disarm_head_timer()
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            if getattr(self, "transport", None) is None:  # refused in connection_made
                return
            if self._client_key is not None:
                table.release(self._client_key, self)
                self._client_key = None
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                logger.info("closing a connection whose request head took over %.3g s", head_timeout_s)
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._disarm_head_timer()
            if self._client_key is not None:
                table.head_arrived(self._client_key, self)
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Idle again (no pipelined request under way): the next head has its deadline.
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()

    return GuardedProtocol
