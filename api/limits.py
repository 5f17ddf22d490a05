"""The request guard: pure ASGI middleware in front of every route.

In this order, before any framework work:

1. With tokens configured (``api.auth``), a request without the token its route needs gets 401
   (403 for a write with the read token) at once: an unauthenticated client never makes the
   service read, buffer or parse a body, nor reads anything but health, metrics and the
   dashboard's static page.
2. A declared ``Content-Length`` over ``max_body_bytes`` gets 413 at once.
3. The body is read in full with a deadline (``body_read_timeout_s``, 408 when a client sends
   too slowly) and a running size check (413 for chunked bodies over the limit, sent once up to
   as much again has been read and dropped, so that the client gets the answer, not a reset),
   then replayed to the app, so routes never see a partial body.
   Without a token (``api.auth``: anyone may write), one client (by address) has at most
   ``max_bodies_per_client`` requests with a body in the service at once (429 after), so a few
   large bodies, not 64, bound its memory; the body itself is counted before it is parsed
   (``api.strictjson.MAX_BODY_VALUES``).
   Service-wide, whoever sends them, the bodies received and held at once count at most
   ``max_body_bytes_in_flight`` bytes, each at :data:`BODY_MEMORY_FACTOR` times its size (what it
   takes while read, joined and parsed), from ``Content-Length`` before anything is read, or as
   a chunked body arrives, until the request ends: past it, 503 with ``Retry-After``, so many
   large bodies from many addresses cannot take the service's memory.
4. Anything the app raises becomes a JSON error (``api.errors.error_response``: 503 for a
   busy, full or read-only store, 500 otherwise) with ``Connection: close``.

Every early answer carries ``Connection: close`` when the body was not read, so the client
cannot mistake the unread bytes for its next request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.auth import DOC_PREFIXES, Tokens

logger = logging.getLogger(__name__)

BODY_MEMORY_FACTOR = 3
"""A body is counted against ``max_body_bytes_in_flight`` at this many times its size: what it
takes in memory while it is received (the chunks), joined, and parsed (its decoded text and
values). With 32 concurrent 31 MB bodies from 4 addresses and the cap at 128 MiB, counting the
bytes alone let four bodies in at once and the service peaked at 484 MB (147 MB idle);
``bench/global_limits.py`` measures it."""

DEFAULT_BODY_BYTES_IN_FLIGHT = 128 * 1024 * 1024
"""The cap on counted body bytes in flight, unless the settings set another (at least
``BODY_MEMORY_FACTOR`` times the largest body)."""


def body_bytes_in_flight_cap(*, max_body_bytes: int, configured: int | None) -> int:
    """The cap on counted body bytes in flight: ``configured``, or the default raised to take at
    least one body of ``max_body_bytes``.

    Raises:
        ValueError: when ``configured`` is below one largest body's count.
    """
    smallest = BODY_MEMORY_FACTOR * max_body_bytes
    if configured is None:
        return max(DEFAULT_BODY_BYTES_IN_FLIGHT, smallest)
    if configured < smallest:
        raise ValueError(f"max_body_bytes_in_flight ({configured}) is below {BODY_MEMORY_FACTOR} x max_body_bytes "
                         f"({smallest}): the largest body (counted at {BODY_MEMORY_FACTOR}x its size) could never "
                         "be taken")
    return configured

async def send_json(send: Send, status: int, detail: object, *, close: bool = False,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send a whole JSON response ``{"detail": detail}``."""
    body = json.dumps({"detail": detail}).encode()
    all_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        all_headers.append((b"connection", b"close"))
    all_headers += headers or []
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value)
    return None


class RequestGuardMiddleware:
    """Auth before body, body size and read deadline, and no unhandled exception on the wire."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_read_timeout_s: float,
                 tokens: Tokens, max_bodies_per_client: int = 8,
                 max_body_bytes_in_flight: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_body_bytes_in_flight = body_bytes_in_flight_cap(max_body_bytes=max_body_bytes,
                                                                 configured=max_body_bytes_in_flight)
        self.body_bytes_in_flight = 0
        """Counted bytes (``BODY_MEMORY_FACTOR`` x size) of the bodies being received or held by
        requests not ended yet (all clients)."""
        self.body_read_timeout_s = body_read_timeout_s
        self.tokens = tokens
        self.max_bodies_per_client = max_bodies_per_client
        self._bodies: dict[str, int] = {}

    async def _refuse(self, scope: Scope, send: Send, *, close: bool) -> None:
        """401 (or 403: the read token on a write) for a request without the token it needs."""
        path: str = scope["path"]
        authorization = _header(scope, b"authorization")
        if self.tokens.can_read(authorization):
            await send_json(send, 403, "the read token cannot write: use the write token (DCP_AUTH_TOKEN)",
                            close=close)
            return
        challenge = b'Basic realm="dcp-planner"' if path.startswith(DOC_PREFIXES) else b"Bearer"
        await send_json(send, 401, "missing or wrong bearer token", close=close,
                        headers=[(b"www-authenticate", challenge)])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        client = self._limited_client(scope)
        if client is not None:
            if self._bodies.get(client, 0) >= self.max_bodies_per_client:
                await send_json(send, 429, f"more than {self.max_bodies_per_client} requests with a body "
                                "at once from this client (set DCP_AUTH_TOKEN to lift the limit)",
                                close=True, headers=[(b"retry-after", b"1")])
                return
            self._bodies[client] = self._bodies.get(client, 0) + 1
        held = [0]  # this request's bytes in ``body_bytes_in_flight``
        try:
            replay = await self._admit(scope, receive, send, held)
            if replay is not None:
                await self.app(scope, replay, tracking_send)
        except Exception as exc:
            # Imported here: api.settings reads this module's cap, and the settings alone
            # (``dcp config show``, a bad config) must not load fastapi.
            from api.errors import error_response

            status, detail, headers = error_response(exc)
            if started:
                logger.exception("error after the response started (%s %s)", scope["method"],
                                 scope["path"][:200])
                raise
            await send_json(send, status, detail, close=True, headers=headers)
        finally:
            self.body_bytes_in_flight -= held[0]
            if client is not None:
                left = self._bodies[client] - 1
                if left:
                    self._bodies[client] = left
                else:
                    del self._bodies[client]

    def _limited_client(self, scope: Scope) -> str | None:
        """The client's address when its request has a body and no token is configured."""
        if self.tokens.enabled or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return None
        length = _header(scope, b"content-length")
        chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
        if not chunked and (length is None or length.strip() in (b"", b"0")):
            return None
        client = scope.get("client")
        return str(client[0]) if client else "unknown"

    def _hold(self, held: list[int], size: int) -> bool:
        """Count this request's body at ``size`` bytes (``BODY_MEMORY_FACTOR`` x that in flight);
        False (nothing more counted) when that would pass ``max_body_bytes_in_flight``."""
        more = BODY_MEMORY_FACTOR * size - held[0]
        if more <= 0:
            return True
        if self.body_bytes_in_flight + more > self.max_body_bytes_in_flight:
            return False
        self.body_bytes_in_flight += more
        held[0] += more
        return True

    async def _busy(self, send: Send) -> None:
        await send_json(send, 503, f"the service holds request bodies counted at {self.body_bytes_in_flight} "
                        f"bytes already (DCP_MAX_BODY_BYTES_IN_FLIGHT={self.max_body_bytes_in_flight}, each "
                        f"body counted at {BODY_MEMORY_FACTOR}x its size); retry",
                        close=True, headers=[(b"retry-after", b"1")])

    async def _admit(self, scope: Scope, receive: Receive, send: Send, held: list[int]) -> Receive | None:
        """Check auth and read the body (its bytes counted in ``held``); the replaying receive,
        or None when answered here."""
        method = scope["method"]
        declared_raw = _header(scope, b"content-length")
        chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
        has_body = chunked or (declared_raw is not None and declared_raw.strip() not in (b"", b"0"))
        if not self.tokens.allows(method, scope["path"], _header(scope, b"authorization")):
            await self._refuse(scope, send, close=has_body)
            return None
        if declared_raw is not None:
            try:
                declared = int(declared_raw)
            except ValueError:
                await send_json(send, 400, "invalid Content-Length header", close=True)
                return None
            if declared > self.max_body_bytes:
                await send_json(send, 413, self._too_large(), close=True)
                return None
            if has_body and not self._hold(held, declared):
                await self._busy(send)
                return None
        if not has_body:
            return receive
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.body_read_timeout_s
        while True:
            left_s = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left_s, 0.001))
            except TimeoutError:
                await send_json(send, 408, f"request body not received within "
                                f"{self.body_read_timeout_s:g} s", close=True)
                return None
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size <= self.max_body_bytes and not self._hold(held, size):  # chunked, or longer than declared
                await self._busy(send)
                return None
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, deadline)
                await send_json(send, 413, self._too_large(), close=True)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        return replay

    async def _drain(self, receive: Receive, deadline: float) -> None:
        """Read and drop the rest of a refused body before answering, up to ``max_body_bytes``
        more and the read deadline. The server closes the connection right after the answer,
        and a socket closed with unread bytes sends a reset, which can reach the client before
        it has read the answer and lose it (what HTTP servers avoid with a lingering close;
        under uvicorn the app can only read before it answers). A longer body is cut off as
        before."""
        dropped = 0
        while dropped <= self.max_body_bytes:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return
            try:
                message = await asyncio.wait_for(receive(), timeout=left_s)
            except TimeoutError:
                return
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                return
            dropped += len(message.get("body", b""))

    def _too_large(self) -> list[dict[str, object]]:
        return [{"loc": ["body"], "type": "body_too_large",
                 "msg": f"request body exceeds {self.max_body_bytes} bytes"}]
