"""Fixtures of the service tests: settings on a tmp SQLite file, a TestClient, a real uvicorn."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from dcp_cli.net import free_port, wait_ready

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
COST_MODEL = "analytic-llama-7b-h200-sxm"
# Small, quick planner settings for tests (deterministic budget; generous wall cap).
FAST: dict[str, object] = {"time_limit_s": 5.0, "use_cpsat": False}


def manifest_lines(num_samples: int, *, seed: int = 0, prefix: str = "s") -> str:
    """A JSON Lines manifest of 1D samples with lengths from 512 to 64k tokens."""
    lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    return "".join(json.dumps({"id": f"{prefix}{i}", "tokens": lengths[(i * 7 + seed) % len(lengths)]})
                   + "\n" for i in range(num_samples))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    data = tmp_path / "data"
    data.mkdir()
    return Settings(db_path=tmp_path / "plans.sqlite", data_dir=data, num_workers=1,
                    auth_token=TOKEN, max_body_bytes=1_000_000, max_samples_per_batch=64)


class ReadingClient(TestClient):
    """A ``TestClient`` whose reads (GET, HEAD) carry the token unless they name an
    ``Authorization`` header, as a rank's or a dashboard's do (every read needs one when a token
    is set); writes carry it only when the test says so."""

    def request(self, method: str, url: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        headers = dict(kwargs.pop("headers", None) or {})
        if method.upper() in ("GET", "HEAD") and not any(k.lower() == "authorization" for k in headers):
            headers.update(AUTH)
        return super().request(method, url, headers=headers, **kwargs)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with ReadingClient(create_app(settings)) as c:
        yield c


class Server:
    """``dcp serve`` in a subprocess (own session, so kill -9 takes its pool workers too)."""

    def __init__(self, tmp_path: Path, *, workers: int = 1, token: str | None = TOKEN,
                 env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.extra_env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.token = token
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tmp_path / "server.log"

    def start(self) -> Server:
        env = {**os.environ, "DCP_DB_PATH": str(self.tmp_path / "plans.sqlite"),
               "DCP_DATA_DIR": str(self.tmp_path / "data"), "DCP_NUM_WORKERS": str(self.workers),
               "DCP_WRITE_BATCH_STEPS": "4", "DCP_MAX_BODY_BYTES": "1000000"}
        if self.token:
            env["DCP_AUTH_TOKEN"] = self.token
        env.update(self.extra_env)
        (self.tmp_path / "data").mkdir(exist_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dcp_cli.main", "serve", "--port", str(self.port),
                 "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.tmp_path)
        wait_ready(self.proc, self.url, log=self.log)
        return self

    def children(self) -> list[int]:
        """Pids of the server's child processes (pool workers, resource tracker)."""
        assert self.proc is not None
        return child_pids(self.proc.pid)

    def solver_workers(self) -> list[int]:
        """Pids of the server's spawned solver workers (its children but the resource tracker)."""
        out = []
        for pid in self.children():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                out.append(pid)
        return out

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**AUTH, **kwargs.pop("headers", {})} if self.token else kwargs.pop("headers", {})
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60.0, **kwargs)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self._reap()
        return code

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def _reap(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        if self.proc is not None:
            self._reap()


def child_pids(parent: int) -> list[int]:
    """Pids whose parent is ``parent``."""
    return [child.pid for child in psutil.Process(parent).children()]


@contextlib.contextmanager
def ray_environ(env: dict[str, str]) -> Iterator[str]:
    """``env`` and a fresh ``RAY_TMPDIR`` (short: Ray's socket paths must fit) in this process's
    environment for the block, which gets the folder; after it the environment is as before and
    the folder is removed."""
    tmp = tempfile.mkdtemp(prefix="dcpray", dir="/tmp")
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {**env, "RAY_TMPDIR": tmp}.items():
                patch.setenv(name, value)
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def make(**kwargs: Any) -> Server:
        server = Server(tmp_path, **kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


def bytes_truth(client: Any, factor: float, cluster: str = "h200x8") -> Any:
    """The served ``COST_MODEL`` with every per-token byte coefficient times ``factor``, written
    out field by field (not through ``costmodel.recalibrate.scale_file``), as a ``CostModel``."""
    from costmodel.evaluate import CostModel
    from costmodel.presets import load_cluster
    from costmodel.schema import CostModelFile

    base = CostModelFile.model_validate(client.get(f"/v1/cost-models/{COST_MODEL}").json())
    act = base.activation
    scaled = act.model_copy(update={key: getattr(act, key) * factor for key in (
        "bytes_per_token_layer_none", "bytes_per_token_layer_full", "working_bytes_per_token",
        "transient_bytes_per_token", "head_transient_bytes_per_token", "alltoall_buffer_bytes_per_token",
        "bytes_per_sample_layer_none")})
    return CostModel(file=base.model_copy(update={"activation": scaled}), cluster=load_cluster(cluster))


def group_peak_bytes(model: Any, group: Any) -> float:
    """The model's peak of a ``GroupPlan``: the largest of its micro-batches'."""
    return float(max(model.microbatch_peak_bytes([ps.sample for ps in mb.samples], group_size=group.size,
                                                 recompute_layers=[ps.recompute_layers for ps in mb.samples])
                     for mb in group.micro_batches))
