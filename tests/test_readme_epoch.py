"""The README's planner-service block runs as written: the example manifest copied into data/, a
real ``dcp serve`` on loopback, every curl (HTTP errors fail), and the offline ``dcp epoch``."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dcp_cli.net import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.timeout(240)


def _service_block() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    return next(b for b in blocks if "dcp serve --port 8000 --db plans.sqlite" in b)


def test_readme_service_block_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    port = free_port()
    block = _service_block().replace(".venv/bin/", f"{BIN}/").replace("localhost:8000", f"127.0.0.1:{port}")
    block = block.replace("--port 8000", f"--port {port}")
    # Every curl fails on an HTTP error; a GET retries while its step is still being planned.
    block = block.replace("curl -s -X POST", "curl -sSf -X POST").replace(
        "curl -s ", "curl -sSf --retry 60 --retry-delay 1 --retry-all-errors ")
    lines = block.splitlines()
    serve = next(i for i, line in enumerate(lines) if " serve " in line)
    setup, rest = "\n".join(lines[:serve]), "\n".join(lines[serve + 1:])
    subprocess.run(["bash", "-euo", "pipefail", "-c", setup], cwd=tmp_path, check=True, timeout=30)
    assert (tmp_path / "data" / "train.jsonl").read_text() == (ROOT / "examples/manifests/train.jsonl").read_text()

    serve_args = shlex.split(lines[serve].split("#")[0].rstrip().removesuffix("&"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCP_")}
    with (tmp_path / "serve.log").open("wb") as log:
        server = subprocess.Popen(serve_args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_ready(server, f"http://127.0.0.1:{port}", log=tmp_path / "serve.log")
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", rest], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=200, check=False)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert '"rank":5' in result.stdout.replace(" ", "") and '"step":3' in result.stdout.replace(" ", "")
        assert "epoch train-s0: done, 8/8 steps in offline.sqlite" in result.stdout
        assert "<h1>Epoch e0</h1>" in (tmp_path / "e0.html").read_text()
        report = tmp_path / "dcp-report"  # the default, outside the source tree
        assert (report / "report.html").exists() and (report / "epoch.svg").exists()
        epochs = httpx.get(f"http://127.0.0.1:{port}/v1/epochs", timeout=10).json()
        # The offline epoch went to its own file, not into the store the server is serving.
        assert {e["epoch_id"] for e in (epochs["epochs"] if isinstance(epochs, dict) else epochs)} == {"e0"}
    finally:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
