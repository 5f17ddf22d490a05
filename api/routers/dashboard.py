"""``GET /dashboard``: a small read-only page of the epoch jobs, their per-step speedup and gap and
a step's Gantt chart. Its script and style are files of this package (``api/dashboard/``) served
here; it loads nothing from elsewhere, so it works on an offline cluster."""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter, Response

router = APIRouter(prefix="/dashboard", tags=["dashboard"])

ASSETS = Path(__file__).resolve().parent.parent / "dashboard"
"""Where the page, its script and its style are."""


@functools.lru_cache(maxsize=4)
def _asset(name: str) -> bytes:
    return (ASSETS / name).read_bytes()


def _ok(media_type: str, what: str) -> dict[int | str, dict[str, object]]:
    return {200: {"description": what, "content": {media_type: {"schema": {"type": "string"}}}}}


@router.get("", response_class=Response, responses=_ok("text/html", "The dashboard page."))
async def dashboard() -> Response:
    """The dashboard: epochs with their progress, per-step speedup and gap, a step's Gantt chart."""
    return Response(content=_asset("index.html"), media_type="text/html")


@router.get("/dashboard.js", response_class=Response, responses=_ok("text/javascript", "Its script."))
async def dashboard_script() -> Response:
    """The dashboard's script (no library)."""
    return Response(content=_asset("dashboard.js"), media_type="text/javascript")


@router.get("/dashboard.css", response_class=Response, responses=_ok("text/css", "Its style sheet."))
async def dashboard_style() -> Response:
    """The dashboard's style sheet."""
    return Response(content=_asset("dashboard.css"), media_type="text/css")
