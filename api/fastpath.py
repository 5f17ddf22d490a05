"""The hot path: ``GET /v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}`` answered before routing.

Every rank fetches its part of every step, so this one route carries almost all the traffic.
This pure ASGI middleware answers a stored rank view with one indexed read and no framework
work; anything else (a step not planned yet, an unknown epoch, a bad path, other methods,
a store busy for more than a few milliseconds) falls through to the FastAPI route, which
gives the same answer for stored views and the documented errors otherwise. The read runs on
the event loop, so it uses the store's fast connection (20 ms busy timeout): a locked store
delays the loop by at most that, once, and the route then waits on a worker thread.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import Tokens
from api.store import PlanStore

if TYPE_CHECKING:
    from api.recalibration import Recalibrator

RANK_VIEW_ROUTE = "/v1/epochs/{epoch_id}/steps/{step}/ranks/{rank}"
_PATH = re.compile(r"^/v1/epochs/([A-Za-z0-9._-]{1,128})/steps/([0-9]{1,9})/ranks/([0-9]{1,9})$")


class RankViewFastPath:
    """Serves stored rank views directly; falls through for everything else."""

    def __init__(self, app: ASGIApp, *, get_store: Callable[[], PlanStore | None],
                 get_recalibrator: Callable[[], Recalibrator | None] = lambda: None,
                 get_tokens: Callable[[], Tokens] = Tokens) -> None:
        self.app = app
        self.get_tokens = get_tokens
        self.get_store = get_store
        self.get_recalibrator = get_recalibrator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            match = _PATH.match(scope["path"])
            store = self.get_store() if match else None
            if match and store is not None:
                epoch_id, step, rank = match.group(1), int(match.group(2)), int(match.group(3))
                recalibrator = self.get_recalibrator()
                try:
                    if recalibrator is None:
                        view = store.get_rank_view(epoch_id, step, rank, fast=True)
                    else:  # the first fetch of a step freezes it (never re-planned afterwards)
                        headers = dict(scope.get("headers") or [])
                        freeze = self.get_tokens().can_read(headers.get(b"authorization"))
                        view = recalibrator.revisions.fetch_rank_view(epoch_id, step, rank, fast=True,
                                                                      freeze=freeze)
                except (ValueError, sqlite3.Error):
                    view = None
                if view is not None:
                    body = view.encode()
                    scope["dcp.route"] = RANK_VIEW_ROUTE
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)
