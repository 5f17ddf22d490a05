"""Who may do what: the service's two bearer tokens.

* No token configured (``DCP_AUTH_TOKEN`` unset): everything is open (a loopback service).
* ``DCP_AUTH_TOKEN`` set: every route but :data:`PUBLIC_PATHS` (health, readiness and the
  dashboard's page, script and style, which hold no data) needs a token. ``/metrics`` is a read
  like the others: its series name epoch ids (a Prometheus scraper sends the read token as its
  ``authorization`` credentials). Writes need the
  write token ``DCP_AUTH_TOKEN``; reads (``GET``, ``HEAD``) take it or the read token
  ``DCP_READ_TOKEN`` (for ranks and dashboards: they can fetch plans, never change anything).
  ``/docs``, ``/redoc`` and ``/openapi.json`` are reads like any other.

A token comes as ``Authorization: Bearer <token>`` or, for a browser opening ``/docs``, as HTTP
Basic with the token as the password (any user name): a 401 on a documentation page asks for
Basic credentials, so the browser prompts for them. Comparisons are constant-time.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from dataclasses import dataclass

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/dashboard", "/dashboard/dashboard.js",
                          "/dashboard/dashboard.css"})
"""Paths open without a token (no data behind them)."""

DOC_PREFIXES = ("/docs", "/redoc", "/openapi.json")
"""Paths a browser opens itself: their 401 asks for Basic credentials."""

READ_METHODS = frozenset({"GET", "HEAD"})
"""Methods the read token is good for."""


def presented_token(authorization: str | bytes | None) -> str | None:
    """The token an ``Authorization`` header carries (Bearer, or Basic's password), or None."""
    if not authorization:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def _same(given: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(given.encode(), expected.encode())


@dataclass(kw_only=True, frozen=True, slots=True)
class Tokens:
    """The configured tokens (``write`` None: auth off)."""

    write: str | None = None
    """``DCP_AUTH_TOKEN``: every route."""
    read: str | None = None
    """``DCP_READ_TOKEN``: reads only (ignored while ``write`` is None)."""

    @property
    def enabled(self) -> bool:
        """Whether any route needs a token."""
        return self.write is not None

    def can_write(self, authorization: str | bytes | None) -> bool:
        """Whether the header carries the write token (True when auth is off)."""
        if not self.enabled:
            return True
        token = presented_token(authorization)
        return token is not None and _same(token, self.write)

    def can_read(self, authorization: str | bytes | None) -> bool:
        """Whether the header carries the read or the write token (True when auth is off)."""
        if not self.enabled:
            return True
        token = presented_token(authorization)
        return token is not None and (_same(token, self.write) | _same(token, self.read))

    def allows(self, method: str, path: str, authorization: str | bytes | None) -> bool:
        """Whether a request may go on: public paths and CORS preflights always, reads with
        either token, everything else with the write token."""
        if not self.enabled or path in PUBLIC_PATHS or method == "OPTIONS":
            return True
        if method in READ_METHODS:
            return self.can_read(authorization)
        return self.can_write(authorization)
