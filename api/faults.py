"""Naming the real cause of infrastructure failures (store busy, full, read-only; pool broken).

``classify`` turns an exception into a :class:`Fault`: a short kind, a message that says what
happened in the operator's terms (never SQLite's follow-up errors, such as ``cannot rollback``),
and whether it is *transient* (worth retrying with backoff: a lock, a full disk, a killed
worker) or not (a bug, or bad input that slipped through).
"""

from __future__ import annotations

import errno
import sqlite3
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass


class StoreLockedError(RuntimeError):
    """Another server holds the store's writer lease."""


class PoolShutDownError(BrokenProcessPool):
    """The solver pool was shut down (the service is stopping) while the task waited or ran."""


class ClusterUnavailableError(ConnectionError):
    """The cluster that plans epoch steps (Ray) cannot be reached, or was lost mid-job."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Fault:
    """What went wrong, for an HTTP answer or a job's error field."""

    kind: str
    """``store-busy``, ``store-full``, ``store-read-only``, ``store-io``, ``pool-broken``, ``pool-stopped``,
    ``cluster-unavailable`` or ``internal``."""
    message: str
    """The cause in plain words."""
    transient: bool
    """True when retrying later may succeed without any change to the request."""


_SQLITE_FAULTS = {
    "SQLITE_BUSY": ("store-busy", "the plan store is locked by another writer; retry"),
    "SQLITE_LOCKED": ("store-busy", "the plan store is locked by another writer; retry"),
    "SQLITE_FULL": ("store-full", "the plan store's disk is full (database or disk is full)"),
    "SQLITE_READONLY": ("store-read-only", "the plan store is read-only (file or folder not writable)"),
    "SQLITE_IOERR": ("store-io", "the plan store hit a disk I/O error"),
    "SQLITE_CANTOPEN": ("store-io", "the plan store file cannot be opened"),
}


def classify(exc: BaseException) -> Fault:
    """The fault behind ``exc`` (``internal`` when it is not an infrastructure failure)."""
    if isinstance(exc, sqlite3.Error):
        name = str(getattr(exc, "sqlite_errorname", "") or "")
        for prefix, (kind, message) in _SQLITE_FAULTS.items():
            if name.startswith(prefix):
                return Fault(kind=kind, message=f"{message} [{name}]", transient=True)
        text = str(exc).lower()
        if "locked" in text or "busy" in text:
            return Fault(kind="store-busy", message=_SQLITE_FAULTS["SQLITE_BUSY"][1], transient=True)
        if "full" in text:
            return Fault(kind="store-full", message=_SQLITE_FAULTS["SQLITE_FULL"][1], transient=True)
        if "readonly" in text or "read-only" in text:
            return Fault(kind="store-read-only", message=_SQLITE_FAULTS["SQLITE_READONLY"][1],
                         transient=True)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Fault(kind="store-full", message=f"disk full: {exc}", transient=True)
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EIO):
        return Fault(kind="store-io", message=f"disk error: {exc}", transient=True)
    if isinstance(exc, ClusterUnavailableError):
        return Fault(kind="cluster-unavailable", message=str(exc)[:500], transient=True)
    if type(exc).__name__ == "DeadlineExceededError":  # api.pool's (no import: pool imports faults' users)
        return Fault(kind="deadline", message=f"a step ran past its deadline ({exc}); a loaded host? retried "
                     "with a larger margin", transient=True)
    if isinstance(exc, PoolShutDownError):
        return Fault(kind="pool-stopped", message="the solver pool shut down", transient=True)
    if isinstance(exc, BrokenProcessPool):
        how = f": {str(exc)[:300]}" if str(exc) else " (killed or out of memory)"
        return Fault(kind="pool-broken", message=f"a solver worker died{how}; it was replaced", transient=True)
    return Fault(kind="internal", message=f"{type(exc).__name__}: {exc}"[:500], transient=False)
