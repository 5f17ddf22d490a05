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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


def guarded_protocol(*, head_timeout_s: float, max_connections: int) -> type[Any]:
    """A uvicorn HTTP protocol class (pass it as ``uvicorn.run(..., http=...)``) with a request
    head deadline and a cap on open connections.

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
            super().connection_made(transport)
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
