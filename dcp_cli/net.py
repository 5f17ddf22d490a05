"""Loopback networking helpers of the local checks, benchmarks and tests (no torch import)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on loopback (free when asked: bind it soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
