"""Turning domain errors into HTTP errors (only the API layer does this)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from fastapi import HTTPException, status


def unprocessable(loc: Sequence[str | int], message: str) -> NoReturn:
    """Raise a 422 shaped like FastAPI's validation errors (field path and reason)."""
    raise HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
                        detail=[{"loc": list(loc), "msg": message, "type": "value_error"}])


def not_found(message: str, *, retry_after_s: int | None = None) -> NoReturn:
    """Raise a 404 with a clear detail.

    Args:
        message: What was not found.
        retry_after_s: When set, the resource is expected to appear (a step still being
            planned): a ``Retry-After`` header tells clients to retry; without it the 404 is final.
    """
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    raise HTTPException(status_code=status.HTTP_404_NOT_FOUND, detail=message, headers=headers)


def conflict(message: str) -> NoReturn:
    """Raise a 409."""
    raise HTTPException(status_code=status.HTTP_409_CONFLICT, detail=message)


def bad_request(message: str) -> NoReturn:
    """Raise a 400."""
    raise HTTPException(status_code=status.HTTP_400_BAD_REQUEST, detail=message)
