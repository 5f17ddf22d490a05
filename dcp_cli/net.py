"""Loopback networking helpers of the local checks, benchmarks and tests (no torch import)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A free TCP port on loopback (free when asked: bind it soon)."""
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
