"""Loopback networking helpers of the local checks, benchmarks and tests (no torch import)."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path

import httpx

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000
"""The lowest port :func:`free_port` hands out (above the registered services most hosts run)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; the IANA 49152 elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return 49_152


def free_port() -> int:
    """A free TCP port on loopback, drawn at random below the kernel's ephemeral range.

    A port the kernel picks for ``bind(("...", 0))`` comes from the ephemeral range, and so do the
    ports of every outgoing connection and of every listener that binds port 0 (gloo's pairs,
    torchrun's agents): between this call closing its probe socket and the caller binding the
    port, any of those can take it, which a busy test run hits now and then (EADDRINUSE). A port
    drawn below that range is never handed out by the kernel on its own, so only another explicit
    bind of the same number can race it (a 1 in ~20,000 draw). Falls back to the kernel's pick
    when the range below is unusable or 200 draws are all taken.
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200 if low - 1 > LOWEST_PORT else 0):
        port = draw.randint(LOWEST_PORT, low - 1)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, *, timeout_s: float = 60.0,
               log: Path | None = None) -> httpx.Response:
    """Poll ``url/readyz`` of a started ``dcp serve`` until it answers 200 (503 while the solver
    pool warms up).

    Returns:
        The 200 answer (its body names the workers).

    Raises:
        RuntimeError: when the process exits first (with the end of ``log``) or is not ready
            within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dcp serve exited with code {proc.returncode} before it was ready{_tail(log)}")
        try:
            ready = httpx.get(f"{url}/readyz", timeout=1.0)
            if ready.status_code == 200:
                return ready
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"dcp serve did not get ready within {timeout_s:.0f} s{_tail(log)}")


def _tail(log: Path | None) -> str:
    """The end of ``log`` after a colon and a line break, or nothing when there is none."""
    tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
    return f":\n{tail}" if tail else ""
