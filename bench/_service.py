"""A ``dcp serve`` subprocess on loopback for the benchmarks (a fresh SQLite file under a folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dcp_cli.net import free_port, wait_ready


def start_service(tmp: Path, *, log: Path | None = None, workers: int = 1, timeout_s: float = 60.0,
                  env: dict[str, str] | None = None, sched_idle: bool = False
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dcp serve`` (no token, ``workers`` solver processes, store ``tmp/plans.sqlite``,
    ``env`` on top of this process's environment) and wait until it is ready; returns the
    process and its base URL. ``sched_idle``: under Linux's ``SCHED_IDLE`` policy (it and its
    solver processes run only on cores nothing else wants), as if on a host of its own.

    Raises:
        RuntimeError: when it is not ready within ``timeout_s``.
    """
    port = free_port()
    out = log.open("wb") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("dcp")), "serve", "--host", "127.0.0.1", "--port", str(port),
         "--db", str(tmp / "plans.sqlite"), "--workers", str(workers), "--log-level", "warning"],
        stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "DCP_AUTH_TOKEN": "", **(env or {})},
        preexec_fn=_sched_idle if sched_idle else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout_s=timeout_s, log=log)
    except RuntimeError:
        if proc.poll() is None:
            stop_service(proc)
        raise
    return proc, url


def _sched_idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def stop_service(proc: subprocess.Popen[bytes], *, timeout_s: float = 60.0) -> None:
    """SIGTERM, then wait for it to exit."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=timeout_s)
