"""One writer per store: an exclusive lease on ``<store>.lock`` held for the server's lifetime.

Two servers on one SQLite file would both run the same epoch jobs (a cancel on one undone by
the other). The lease is an ``flock`` on a file beside the store, so the kernel releases it
when the holder dies in any way (kill -9 included): there is never a stale lease to clean up.
A second server on the same file refuses to start and names the holder's pid. ``flock`` is
advisory and local: a store on a network file system shared by several machines is not
protected (keep the store on a local disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import IO

from api.faults import StoreLockedError

logger = logging.getLogger(__name__)


def lease_path(store_path: Path) -> Path:
    """The lock file of a store."""
    return store_path.with_name(store_path.name + ".lock")


class StoreLease:
    """The writer lease of a store (``acquire`` / ``release``; a context manager too)."""

    def __init__(self, store_path: Path) -> None:
        # The file, not the name: a symlink (or a relative path) to the same store takes the same
        # lease (api/lease.py's lock file beside the resolved store), and the store file itself is
        # flocked too, so that a hard link to it is refused as well.
        self.store = store_path.resolve()
        self.path = lease_path(self.store)
        self._fh: IO[str] | None = None
        self._store_fh: IO[bytes] | None = None

    def acquire(self) -> StoreLease:
        """Take the lease.

        Raises:
            StoreLockedError: naming the store and the pid holding it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = self.path.open("a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise StoreLockedError(
                f"the plan store {self.path.with_suffix('')} is in use by another server (pid {holder}); "
                "stop it, or give this one another --db") from None
        # flock and SQLite's own (fcntl) locks are independent on Linux: this one only keeps a
        # second server out. Opening in append mode creates an empty file SQLite takes as new.
        store_fh = self.store.open("ab")
        try:
            fcntl.flock(store_fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            store_fh.close()
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            fh.close()
            raise StoreLockedError(
                f"the plan store {self.store} is in use by another server (through another name for the "
                "same file); stop it, or give this one another --db") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh, self._store_fh = fh, store_fh
        logger.info("writer lease on %s taken (pid %d)", self.path, os.getpid())
        return self

    def release(self) -> None:
        """Give the lease back (idempotent)."""
        if self._store_fh is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._store_fh.fileno(), fcntl.LOCK_UN)
            self._store_fh.close()
            self._store_fh = None
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.seek(0)
                self._fh.truncate()
                fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __enter__(self) -> StoreLease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
