"""Whether a Ray cluster is still there: a TCP probe of its GCS port while tasks run.

Ray notices a lost cluster late (a driver waits on tasks of a head that is gone), so the
executor's collector asks :class:`ClusterWatch` each round; every ``HEALTH_PROBE_S`` it opens
a connection to the watched port (the GCS; with Ray Client, its server) and after
``LOST_AFTER_PROBES`` failures in a row it reports the cluster lost, and the executor fails the
running steps with a transient fault (``api.ray_runner``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from api.ray_config import host_port

logger = logging.getLogger(__name__)

HEALTH_PROBE_S = 1.0
"""While tasks run, the collector checks this often that the cluster's GCS port answers."""
LOST_AFTER_PROBES = 3
"""Failed probes in a row after which the cluster is taken as lost (the running steps fail)."""


class ClusterWatch:
    """Probes one port at most every ``every_s``; says when it has been silent too often."""

    def __init__(self, target: tuple[str, int] | None, *, every_s: float = HEALTH_PROBE_S,
                 lost_after: int = LOST_AFTER_PROBES, clock: Callable[[], float] = time.monotonic) -> None:
        """Watch ``target``.

        Args:
            target: ``(host, port)`` to probe; None watches nothing (never lost).
            every_s: Seconds between probes (also each probe's connect timeout).
            lost_after: Failed probes in a row that make the cluster lost.
            clock: Monotonic seconds.
        """
        self.target, self.every_s, self.lost_after, self._clock = target, every_s, lost_after, clock
        self._last_s = clock()
        self._failed = 0

    @classmethod
    def of(cls, ray: Any, address: str) -> ClusterWatch:
        """The watch of a connected driver: the Ray Client server for ``ray://`` addresses, else the
        GCS the runtime context names (nothing watched, with a warning, when it names none)."""
        if address.startswith("ray://"):
            return cls(host_port(address))
        try:
            return cls(host_port(str(ray.get_runtime_context().gcs_address)))
        except Exception as exc:
            logger.warning("ray: no GCS address to watch (%s); a lost cluster is noticed by Ray only", exc)
            return cls(None)

    def reset(self) -> None:
        """Start counting afresh (a new collector round)."""
        self._last_s, self._failed = self._clock(), 0

    def _answers(self) -> bool:
        if self.target is None:
            return True
        try:
            socket.create_connection(self.target, timeout=self.every_s).close()
        except OSError:
            return False
        return True

    def lost(self) -> str | None:
        """Probe when one is due; why the cluster is taken as lost (then the count restarts), or None."""
        if self._clock() - self._last_s < self.every_s:
            return None
        self._last_s = self._clock()
        self._failed = 0 if self._answers() else self._failed + 1
        if self._failed < self.lost_after:
            return None
        failed, self._failed = self._failed, 0
        host, port = self.target or ("?", 0)
        return f"{host}:{port} has not answered {failed} probes {self.every_s:g} s apart"
