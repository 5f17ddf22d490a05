"""Turning domain errors into HTTP errors (only the API layer does this)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NoReturn

from fastapi import FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.faults import classify
from api.strictjson import excerpt

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 500
"""Longest error message sent back (a validator's message may quote the input)."""


def bounded(message: str) -> str:
    """A message cut to ``MAX_MESSAGE_CHARS`` and made encodable (it may quote the input)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."


def unprocessable(loc: Sequence[str | int], message: str) -> NoReturn:
    """Raise a 422 shaped like FastAPI's validation errors (field path and reason)."""
    raise HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
                        detail=[{"loc": list(loc), "msg": bounded(message), "type": "value_error"}])


def not_found(message: str, *, retry_after_s: int | None = None) -> NoReturn:
    """Raise a 404 with a clear detail.

    Args:
        message: What was not found.
        retry_after_s: When set, the resource is expected to appear (a step still being
            planned): a ``Retry-After`` header tells clients to retry; without it the 404 is final.
    """
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    raise HTTPException(status_code=status.HTTP_404_NOT_FOUND, detail=bounded(message), headers=headers)


def conflict(message: str) -> NoReturn:
    """Raise a 409."""
    raise HTTPException(status_code=status.HTTP_409_CONFLICT, detail=bounded(message))


def bad_request(message: str) -> NoReturn:
    """Raise a 400."""
    raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail=bounded(message))


def service_unavailable(message: str, *, retry_after_s: int = 1) -> NoReturn:
    """Raise a 503 with ``Retry-After`` (the store or the pool is failing; the request was fine)."""
    raise HTTPException(status_code=status.HTTP_503_SERVICE_UNAVAILABLE, detail=message,
                        headers={"Retry-After": str(retry_after_s)})


def error_response(exc: BaseException) -> tuple[int, str, list[tuple[bytes, bytes]]]:
    """Status, detail and extra headers answering an exception no route handled.

    Infrastructure faults (store busy, full, read-only, broken pool) are a 503 naming the cause
    with ``Retry-After``; anything else is a 500 whose detail does not leak internals (the
    traceback is logged).
    """
    fault = classify(exc)
    if fault.kind != "internal":
        logger.warning("request failed: %s (%s: %s)", fault.message, type(exc).__name__, exc)
        return 503, fault.message, [(b"retry-after", b"1")]
    logger.error("unhandled error", exc_info=exc)
    return 500, "internal error (logged by the service)", []


def _safe_error(error: dict[str, Any]) -> dict[str, Any]:
    """A validation error with a bounded, encodable location and message and no input echo."""
    loc = [part if isinstance(part, int) else excerpt(str(part)) for part in error.get("loc", ())]
    return {"loc": loc, "msg": bounded(str(error.get("msg", "invalid value"))),
            "type": str(error.get("type", "value_error"))[:100]}


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
                        content={"detail": [_safe_error(dict(e)) for e in errors[:20]]})


def install_error_handlers(app: FastAPI) -> None:
    """422 bodies that name the field and the reason and never echo the (maybe huge) input."""
    app.add_exception_handler(RequestValidationError, _validation_handler)


COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Malformed request (an invalid Content-Length, or a body that is not JSON)."},
    401: {"description": "A write without the bearer token (when DCP_AUTH_TOKEN is set)."},
    408: {"description": "The request body was not received within DCP_BODY_READ_TIMEOUT_S."},
    413: {"description": "The request body exceeds DCP_MAX_BODY_BYTES."},
    503: {"description": "The store is busy (locked by another process), full or read-only, or the "
                         "solver pool is unavailable; the detail names the cause. Retry-After."},
}
"""Answers every route may give (added to each router, so the OpenAPI document lists them)."""
