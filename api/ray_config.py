"""Where the Ray cluster of epoch jobs is, and how steps are sent to it (no Ray import)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

LOCAL = "local"
"""Address that starts a Ray instance in this process (one machine; tests and benchmarks)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RayConfig:
    """Where the Ray cluster is and how steps are sent to it."""

    address: str
    """``auto`` (a cluster this machine belongs to, or ``RAY_ADDRESS``), ``host:port`` (its GCS),
    ``ray://host:port`` (Ray Client), or ``local`` (a new instance in this process)."""
    steps_per_task: int = 4
    """Steps planned by one Ray task (more: less scheduling per step, more re-planning after a
    killed worker)."""
    max_retries: int = 3
    """Ray re-runs a task whose worker or node died this many times before the job fails."""
    connect_timeout_s: float = 5.0
    """Longest wait for the cluster's port to answer before giving up with a clear error."""
    local_num_cpus: int | None = None
    """CPUs of a ``local`` instance (None: all of this machine's)."""

    def __post_init__(self) -> None:
        if not self.address.strip():
            raise ValueError("ray address must not be empty (auto, host:port, ray://host:port or local)")
        if self.steps_per_task < 1:
            raise ValueError(f"steps_per_task must be at least 1, got {self.steps_per_task}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be positive, got {self.connect_timeout_s}")
        if self.local_num_cpus is not None and self.local_num_cpus < 1:
            raise ValueError(f"local_num_cpus must be at least 1, got {self.local_num_cpus}")
        if self.address not in ("auto", LOCAL):
            host_port(self.address)


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``ray://host:port``.

    Raises:
        ValueError: naming the address when it has no host or port.
    """
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    if parts.scheme not in ("gcs", "ray") or not parts.hostname:
        raise ValueError(f"ray address {address!r} is not auto, local, host:port or ray://host:port")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"ray address {address!r} has no valid port (host:port or ray://host:port)")
    return parts.hostname, port
