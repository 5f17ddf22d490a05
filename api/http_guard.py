"""Connection-level limits uvicorn does not have: a deadline on each request head, and a cap on
open connections.

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


def server_options(*, head_timeout_s: float, max_connections: int) -> dict[str, Any]:
    """uvicorn's connection settings for ``dcp serve`` (``uvicorn.run(app, **server_options(...))``
    or ``uvicorn.Config``): the guarded protocol, a listen backlog of ``max_connections`` (at most
    2,048), and the asyncio event loop (:data:`EVENT_LOOP`).

    Args:
        head_timeout_s: Seconds a request head may take to arrive (:func:`guarded_protocol`).
        max_connections: Open connections at most (:func:`guarded_protocol`).

    Raises:
        ValueError: for a non-positive timeout or cap.
    """
    return {"http": guarded_protocol(head_timeout_s=head_timeout_s, max_connections=max_connections),
            "backlog": min(max_connections, 2048), "loop": EVENT_LOOP}


def guarded_protocol(*, head_timeout_s: float, max_connections: int) -> type[Any]:
    """A uvicorn HTTP protocol class (pass it as ``uvicorn.run(..., http=...)``) with a request
    head deadline, a cap on open connections, and one socket write per response
    (:class:`CoalescingTransport`).

    Args:
        head_timeout_s: Seconds a request head may take to arrive, from the connection's start or
            the end of its previous response.
        max_connections: Open connections at most; one more is closed as soon as it is accepted.

    Raises:
        ValueError: for a non-positive timeout or cap.
    """
    if not head_timeout_s > 0:
        raise ValueError(f"head_timeout_s must be positive, got {head_timeout_s}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools: a dependency

    class GuardedProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """uvicorn's protocol with a head deadline and a connection cap (module docstring)."""

        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            if len(self.connections) >= max_connections:
                logger.warning("connection refused: %d open already (DCP_MAX_CONNECTIONS)", len(self.connections))
                transport.abort()
                return
            # duck-typed: it has every method uvicorn's protocol calls on a transport
            super().connection_made(cast(asyncio.Transport, CoalescingTransport(transport, self.loop)))
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            if getattr(self, "transport", None) is None:  # refused in connection_made
                return
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
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Idle again (no pipelined request under way): the next head has its deadline.
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()

    return GuardedProtocol
