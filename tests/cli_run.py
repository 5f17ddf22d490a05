"""The installed ``dcp`` command run from the CLI tests: a clean environment, one command, a server
started from a config file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from dcp_cli.net import free_port, wait_ready

DCP = str(Path(sys.executable).parent / "dcp")


def dcp_env(**extra: str) -> dict[str, str]:
    """This process's environment without its ``DCP_*`` variables (only the test's settings count),
    200 columns for the tables, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCP_")}
    env.update({"COLUMNS": "200", **extra})
    return env


def run_dcp(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``dcp ARGS`` in ``cwd`` (environment :func:`dcp_env` unless ``env``), its output captured."""
    return subprocess.run([DCP, *args], cwd=cwd, env=env or dcp_env(), capture_output=True, text=True, timeout=200)


@contextlib.contextmanager
def serving_config(cwd: Path, *, env: dict[str, str] | None = None) -> Iterator[tuple[str, httpx.Response]]:
    """``dcp serve --config dcp.toml`` in ``cwd`` on a free port (log ``cwd/serve.log``), for the
    block: its URL and its first ready ``/readyz`` answer; SIGTERM after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (cwd / "serve.log").open("wb") as log:
        server = subprocess.Popen([DCP, "serve", "--config", "dcp.toml", "--port", str(port)], cwd=cwd,
                                  env=env or dcp_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield url, wait_ready(server, url, log=cwd / "serve.log")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
