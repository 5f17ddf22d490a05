"""``/redoc`` served entirely by the service: ReDoc's script and the logo it shows.

``fastapi-offline`` ships ReDoc's standalone bundle, but the bundle's side menu ends with an
``<img src="https://cdn.redoc.ly/redoc/logo-mini.svg">`` ("API docs by Redocly"), the one
request any of the service's pages made off the machine. This module serves the page itself
(the same HTML as FastAPI's ``get_redoc_html``), the bundle with that one URL replaced by the
service's own ``/redoc-assets/logo-mini.svg``, and that logo (a small SVG drawn here).
"""

from __future__ import annotations

import functools
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from starlette.responses import HTMLResponse, Response

ASSETS_URL = "/redoc-assets"
"""Where the patched bundle and the logo are served (under ``/redoc``: the docs' auth rule)."""

CDN_LOGO_URL = "https://cdn.redoc.ly/redoc/logo-mini.svg"
"""The URL the bundle's side menu loads its logo from."""

LOGO_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">'
    '<rect x="1" y="1" width="14" height="14" rx="3" fill="#32329f"/>'
    '<path d="M5 4h4a2.5 2.5 0 0 1 0 5H7l3 3H8L5 9V4zm2 2v1.5h2a.75.75 0 0 0 0-1.5H7z" fill="#fff"/></svg>'
)
"""The side menu's logo: a plain "R" on ReDoc's blue, drawn here so nothing is fetched."""

_BUNDLE = Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js"


@functools.cache
def patched_bundle() -> bytes:
    """ReDoc's bundle with its logo URL pointing at the service.

    Raises:
        ValueError: when the installed bundle does not hold :data:`CDN_LOGO_URL` exactly once
            (a new ReDoc version: the patch would silently miss).
    """
    text = _BUNDLE.read_text(encoding="utf-8")
    if text.count(CDN_LOGO_URL) != 1:
        raise ValueError(f"{_BUNDLE} names {CDN_LOGO_URL!r} {text.count(CDN_LOGO_URL)} times, expected once")
    return text.replace(CDN_LOGO_URL, f"{ASSETS_URL}/logo-mini.svg").encode("utf-8")


def install_redoc(app: FastAPI, *, redoc_url: str = "/redoc", favicon_url: str) -> None:
    """Add the ReDoc page and its two assets to ``app`` (made with ``redoc_url=None``).

    Args:
        app: The service app.
        redoc_url: The page's path.
        favicon_url: The favicon the page links to (served by the app).
    """
    patched_bundle()  # refuse to start with a bundle the patch does not fit

    @app.get(redoc_url, include_in_schema=False)
    async def redoc_html(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{favicon_url}", with_google_fonts=False)

    @app.get(f"{ASSETS_URL}/redoc.standalone.js", include_in_schema=False)
    async def redoc_bundle() -> Response:
        return Response(patched_bundle(), media_type="application/javascript",
                        headers={"Cache-Control": "public, max-age=3600"})

    @app.get(f"{ASSETS_URL}/logo-mini.svg", include_in_schema=False)
    async def redoc_logo() -> Response:
        return Response(LOGO_SVG, media_type="image/svg+xml", headers={"Cache-Control": "public, max-age=3600"})
