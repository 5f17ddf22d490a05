"""Strict JSON request bodies: finite numbers, bounded integers, valid Unicode, parsed off the loop.

Python's ``json`` accepts ``NaN``, ``Infinity``, ``1e400`` (a float overflow to infinity),
integers of thousands of digits and lone UTF-16 surrogates (``"\\ud800"``); none of them is
valid input to the planner, SQLite or a JSON response. ``strict_loads`` rejects each with a
422 naming the field (``loc``) and the reason, before any model sees the value. Bodies larger
than ``INLINE_PARSE_BYTES`` are parsed on a worker thread, so a large body never stalls the
event loop; the object hook is Python code, so the parsing thread yields the GIL regularly.

Routers opt in with ``APIRouter(route_class=StrictJSONRoute)``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

MAX_JSON_INT = 2**63 - 1
"""Largest integer magnitude accepted anywhere in a body (SQLite's INTEGER range)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays accepted."""
MAX_CONTAINER_ITEMS = 16384
"""Most items of one array or object (``api.schemas.MAX_SAMPLES_PER_REQUEST``): a request model
validates a list in full before it checks its length, on the event loop, so a longer list is
refused here, on the parsing thread."""
OBJECT_WEIGHT = 8
"""What one object counts for against ``MAX_BODY_VALUES`` (a number counts 1): a parsed dict
takes 64-600 bytes, a number 24-32."""
MAX_BODY_VALUES = 72 * MAX_CONTAINER_ITEMS
"""Most weighted values (numbers, and objects at ``OBJECT_WEIGHT``) in one body: 1,179,648, so
that the largest legitimate bodies fit (16,384 samples; a measurement post of 256 steps of 4,096
micro-batch times) and parsing stops, with a 413, as soon as a body passes it (tens of MB parsed
at most, where a body of 1e6 samples was parsed whole, ~12x its size)."""
INLINE_PARSE_BYTES = 64 * 1024
"""Bodies up to this size are parsed on the event loop (a thread hop costs more)."""
MAX_ECHO_CHARS = 80
"""Longest excerpt of a rejected value quoted back in an error."""


class _Bad:
    """A rejected scalar, kept in place so that its location can be reported."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def excerpt(value: object) -> str:
    """A short, always-encodable excerpt of a value for an error message."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + f"... ({len(text)} chars)"


def _parse_float(text: str) -> float | _Bad:
    value = float(text)
    if not math.isfinite(value):
        return _Bad(f"number {excerpt(text)} is out of the finite float range")
    return value


def _parse_int(text: str) -> int | _Bad:
    if len(text.lstrip("-")) > 19:
        return _Bad(f"integer of {len(text.lstrip('-'))} digits is out of range (|n| <= 2^63-1)")
    value = int(text)
    if abs(value) > MAX_JSON_INT:
        return _Bad(f"integer {text} is out of range (|n| <= 2^63-1)")
    return value


def _parse_constant(text: str) -> _Bad:
    return _Bad(f"{text} is not a JSON number; numbers must be finite")


def _find_bad(value: Any, loc: list[str | int], depth: int) -> tuple[list[str | int], str] | None:
    """The location and reason of the first rejected value, depth first."""
    if isinstance(value, _Bad):
        return loc, value.reason
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return loc, "string holds a lone UTF-16 surrogate (not valid Unicode)"
        return None
    if depth > MAX_JSON_DEPTH and isinstance(value, dict | list):
        return loc, f"nesting deeper than {MAX_JSON_DEPTH} levels"
    if isinstance(value, dict | list) and len(value) > MAX_CONTAINER_ITEMS:
        return loc, f"{len(value)} items exceed the limit of {MAX_CONTAINER_ITEMS} per array or object"
    if isinstance(value, dict):
        for key, item in value.items():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                return loc, "object key holds a lone UTF-16 surrogate (not valid Unicode)"
            found = _find_bad(item, [*loc, key], depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _find_bad(item, [*loc, index], depth + 1)
            if found is not None:
                return found
    return None


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = True


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC while a body is parsed: a JSON value has no cycles, and a full collection
    over a large body's objects would hold the GIL (and so the event loop) for tens of ms."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


DISPOSE_SLICE = 2048
"""Items freed at a time when a large rejected body is dropped."""


def _dispose(value: Any) -> None:
    """Free a (large) parsed value a slice at a time: freeing a list of a million objects in one
    go is C code that holds the GIL for tens of ms; between slices other threads run."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            while item:
                chunk = item[-DISPOSE_SLICE:]
                del item[-DISPOSE_SLICE:]
                stack.extend(c for c in chunk if isinstance(c, list | dict) and len(c) > DISPOSE_SLICE)
                del chunk


class _TooManyValuesError(Exception):
    """Raised from a parse hook once a body passes ``MAX_BODY_VALUES``."""


class _Counted:
    """The parse hooks of one body, counting numbers and objects as they are made."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_BODY_VALUES

    def _spend(self, cost: int) -> None:
        self.left -= cost
        if self.left < 0:
            raise _TooManyValuesError

    def parse_float(self, text: str) -> float | _Bad:
        self._spend(1)
        return _parse_float(text)

    def parse_int(self, text: str) -> int | _Bad:
        self._spend(1)
        return _parse_int(text)

    def object_pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self._spend(OBJECT_WEIGHT)
        return dict(pairs)


def strict_loads(body: bytes) -> Any:
    """Parse a JSON request body, rejecting what the service cannot represent.

    Raises:
        HTTPException: 413 for a body of more than ``MAX_BODY_VALUES`` values (while parsing);
            422 with ``detail=[{loc, msg, type}]`` naming the offending field.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _invalid(["body"], f"body is not UTF-8 (byte {exc.start})", "json_invalid") from None
    with _gc_paused():
        try:
            hooks = _Counted()
            value = json.loads(text, parse_float=hooks.parse_float, parse_int=hooks.parse_int,
                               parse_constant=_parse_constant, object_pairs_hook=hooks.object_pairs)
        except _TooManyValuesError:
            raise HTTPException(status_code=status.HTTP_413_CONTENT_TOO_LARGE,
                                detail=f"body holds more than {MAX_BODY_VALUES} JSON values (objects count "
                                       f"{OBJECT_WEIGHT}); parsing stopped there") from None
        except json.JSONDecodeError as exc:
            raise _invalid(["body", exc.pos], f"JSON decode error: {exc.msg}", "json_invalid") from None
        except RecursionError:
            raise _invalid(["body"], "JSON nesting too deep", "json_invalid") from None
        del text
        found = _find_bad(value, ["body"], 0)
        if found is not None:
            _dispose(value)
            loc, reason = found
            raise _invalid([excerpt(p) if isinstance(p, str) else p for p in loc], reason, "value_error")
    return value


def _invalid(loc: list[str | int], message: str, kind: str) -> HTTPException:
    return HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
                         detail=[{"loc": loc, "msg": message, "type": kind}])


class StrictJSONRequest(Request):
    """A request whose ``json()`` is :func:`strict_loads`, on a thread for large bodies."""

    async def json(self) -> Any:
        """The parsed body (cached)."""
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= INLINE_PARSE_BYTES:
                self._json = strict_loads(body)
            else:
                self._json = await asyncio.to_thread(strict_loads, body)
        return self._json


class StrictJSONRoute(APIRoute):
    """An ``APIRoute`` whose handler sees a :class:`StrictJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The default handler, given the strict request."""
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler
