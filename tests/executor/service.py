"""A real planner service (``dcp serve`` in a subprocess) for the executor's HTTP tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from costmodel.analytic import analytic_cost_model
from costmodel.presets import load_cluster
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from dcp_cli.net import free_port
from tests.executor.helpers import CONFIG

OPTIONS: dict[str, object] = {"time_limit_s": 5.0, "use_cpsat": False, "layout": "ulysses"}
"""Planner options of the test epochs (quick, deterministic; pure Ulysses, as the registries these tests
build by group size run: a test of rings names its layout)."""


class Service:
    """Start, stop and restart ``dcp serve`` on a fixed port and SQLite file."""

    def __init__(self, *, port: int, db_path: Path, log_path: Path) -> None:
        self.port, self.db_path, self.log_path = port, db_path, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *, wait_s: float = 60.0) -> None:
        """Start the service and wait until ``/healthz`` answers."""
        dcp = Path(sys.executable).with_name("dcp")
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(dcp), "serve", "--host", "127.0.0.1", "--port", str(self.port), "--db",
             str(self.db_path), "--workers", "1", "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DCP_AUTH_TOKEN": ""})
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dcp serve exited: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"dcp serve did not come up in {wait_s} s")

    def stop(self) -> None:
        """Stop the service (SIGTERM, then SIGKILL) and wait for it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def running_service(tmp: Path) -> Iterator[Service]:
    """A :class:`Service` on a free port with its store and log in ``tmp``, running for the block."""
    svc = Service(port=free_port(), db_path=tmp / "plans.sqlite", log_path=tmp / "serve.log")
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def tiny_setup() -> tuple[ClusterSpec, CostModelFile]:
    """A 4-rank cluster and an analytic cost model of the test model (policies 0..L)."""
    spec = ModelSpec(name="ref-llama-test", kind="1d", num_layers=CONFIG.num_layers,
                     hidden=CONFIG.hidden, num_heads=CONFIG.num_heads,
                     ffn_hidden=CONFIG.ffn_hidden, vocab=CONFIG.vocab)
    cluster = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": 4,
                                                        "gpus_per_node": 4})
    return cluster, analytic_cost_model(spec, cluster.hardware)


def tiny_manifest(num_samples: int) -> list[Sample]:
    """1D samples of 3..60 tokens."""
    return [Sample(id=f"t{i}", tokens=3 + (i * 37) % 58) for i in range(num_samples)]


def start_epoch(url: str, *, epoch_id: str, samples: list[Sample], samples_per_step: int,
                seed: int, cluster: ClusterSpec, cost_model: CostModelFile,
                options: dict[str, object] | None = None) -> dict[str, object]:
    """Upload the cost model and start an epoch job (planner ``options``, default :data:`OPTIONS`);
    wait until it is done."""
    httpx.post(f"{url}/v1/cost-models", json=cost_model.model_dump(mode="json"), timeout=30)
    body = {"epoch_id": epoch_id,
            "manifest_jsonl": "\n".join(json.dumps(s.model_dump(exclude_none=True)) for s in samples),
            "batch": {"samples_per_step": samples_per_step}, "seed": seed,
            "cluster": cluster.model_dump(mode="json"), "cost_model_id": cost_model.id,
            "options": OPTIONS if options is None else options}
    response = httpx.post(f"{url}/v1/epochs", json=body, timeout=30)
    response.raise_for_status()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/epochs/{epoch_id}", timeout=10).json()
        if status["state"] in ("done", "failed", "cancelled"):
            if status["state"] != "done":
                raise RuntimeError(f"epoch {epoch_id} ended {status['state']}: {status['error']}")
            return dict(status)
        time.sleep(0.1)
    raise RuntimeError(f"epoch {epoch_id} did not finish in 60 s")
