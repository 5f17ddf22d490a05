"""Epoch steps as Ray tasks on a simulated two-node cluster (``ray.cluster_utils.Cluster``).

One module-scoped cluster (head + one worker node, one CPU each) serves every test: plans and
digests equal the process pool's; a worker killed mid-task is retried by Ray and nothing is
stored twice; a killed ``dcp epoch --ray-address`` driver resumes from the stored steps; the
service plans a job on the cluster when ``ray_address`` is set; an unreachable address is
refused at once, naming it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
from api.faults import ClusterUnavailableError, classify
from api.jobs import prepare_epoch, run_epoch_job
from api.pool import make_executor
from api.settings import Settings
from api.store import PlanStore
from costmodel.presets import default_cost_model_file, load_cluster
from dcp_cli.net import free_port
from planner.epoch import BatchRule
from planner.workload import read_manifest

from .conftest import AUTH, COST_MODEL, FAST, TOKEN, ReadingClient, child_pids, manifest_lines, ray_environ

ray = pytest.importorskip("ray")

from api.ray_runner import RayConfig, RayStepExecutor, connect_executor  # noqa: E402

pytestmark = pytest.mark.timeout(180)

NUM_SAMPLES = 384
"""48 steps: each test that interrupts the epoch does so a moment after its first steps, with
tens of steps still to plan; five tests each plan the whole epoch once."""
SAMPLES_PER_STEP = 8
SEED = 7
NUM_STEPS = NUM_SAMPLES // SAMPLES_PER_STEP
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           # As the service's driver (api.ray_runner.GCS_RECONNECT_TIMEOUT_S), and for the raylets:
           # a lost GCS must not end this process (the driver) while the runner's probes judge it.
           "RAY_gcs_rpc_server_reconnect_timeout_s": "3600"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head node and a worker node (one CPU each) on this machine; this process is the driver."""
    from ray.cluster_utils import Cluster

    with ray_environ(RAY_ENV):
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        c.add_node(num_cpus=1)
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        try:
            yield c
        finally:
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ray") / "m.jsonl"
    path.write_text(manifest_lines(NUM_SAMPLES))
    return path


def _new_job(db: Path, manifest: Path, epoch_id: str = "e") -> PlanStore:
    store = PlanStore.open(db)
    prepare_epoch(store, epoch_id=epoch_id, samples=read_manifest(manifest),
                  rule=BatchRule(samples_per_step=SAMPLES_PER_STEP), seed=SEED, cluster=load_cluster("h200x8"),
                  cost_model=default_cost_model_file("llama-7b", "h200-sxm"), options=FAST,
                  manifest_source=str(manifest))
    return store


def _digests(db: Path, epoch_id: str) -> list[tuple[int, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT step, digest FROM plans WHERE epoch_id=? ORDER BY step",
                            (epoch_id,)).fetchall()


def _cost_model(_: str) -> Any:
    return default_cost_model_file("llama-7b", "h200-sxm")


@pytest.fixture(scope="module")
def pool_digests(manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, str]]:
    """The job planned by the process pool (the reference)."""
    db = tmp_path_factory.mktemp("pool") / "p.sqlite"
    store = _new_job(db, manifest)
    executor = make_executor(1)
    try:
        final = run_epoch_job(store, "e", get_cost_model=_cost_model, executor=executor, num_workers=1)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        store.close()
    assert final.state == "done", final.error
    digests = _digests(db, "e")
    assert len(digests) == NUM_STEPS
    return digests


def _ray_workers_running(name: str = "plan_step_batch") -> list[int]:
    """Pids of Ray workers whose process title says they run ``name`` now."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(f"ray::{name}".encode()):
                pids.append(int(entry))
    return pids


def test_unreachable_cluster_is_refused_naming_it(cluster: Any) -> None:
    port = free_port()
    # Judged by the cause, not the clock: the refusal comes from the TCP probe of the address
    # (connection refused), before any Ray call could wait on the missing cluster.
    with pytest.raises(ClusterUnavailableError, match=f"127.0.0.1:{port}.*unreachable") as info:
        connect_executor(RayConfig(address=f"127.0.0.1:{port}", connect_timeout_s=2.0))
    assert "Connection refused" in str(info.value), info.value
    assert classify(info.value).transient
    with pytest.raises(ValueError, match="no valid port"):
        RayConfig(address="ray://somewhere")


def test_cli_refuses_an_unreachable_cluster_before_creating_the_store(manifest: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from dcp_cli.main import app

    port = free_port()
    out = tmp_path / "never.sqlite"
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, [
        "epoch", str(manifest), "--samples-per-step", "8", "--out", str(out), "--ray-address", f"127.0.0.1:{port}"])
    assert result.exit_code == 2
    assert f"--ray-address: the Ray cluster at '127.0.0.1:{port}' is unreachable" in " ".join(result.output.split())
    assert not out.exists()


@pytest.mark.timeout(900)  # a hang guard: 200 steps once took ~8 min beside a second suite on 2 cores
def test_service_plans_on_the_cluster_with_the_pool_digests(
        cluster: Any, manifest: Path, pool_digests: list[tuple[int, str]], tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    settings = Settings(db_path=tmp_path / "s.sqlite", data_dir=data, num_workers=1, auth_token=TOKEN,
                        ray_address=cluster.address, ray_steps_per_task=4)
    body = {"epoch_id": "e", "manifest_jsonl": manifest.read_text(),
            "batch": {"samples_per_step": SAMPLES_PER_STEP}, "seed": SEED, "cluster": "h200x8",
            "cost_model_id": COST_MODEL, "options": FAST}
    rates: list[float] = []
    with ReadingClient(create_app(settings)) as client:
        created = client.post("/v1/epochs", json=body, headers=AUTH)
        assert created.status_code == 202, created.text
        while True:  # until the job ends: judged by its state, not a deadline (beside a second
            # suite on 2 cores it was 51 of 200 steps in at 120 s); the suite's timeout guards a hang
            status = client.get("/v1/epochs/e").json()
            if status["steps_per_s"]:
                rates.append(status["steps_per_s"])
            if status["state"] not in ("queued", "running"):
                break
            time.sleep(0.05)
    assert status["state"] == "done", status
    assert rates and all(r > 0 for r in rates)
    assert _digests(settings.db_path, "e") == pool_digests


def test_killed_worker_is_retried_and_nothing_is_stored_twice(
        cluster: Any, manifest: Path, pool_digests: list[tuple[int, str]], tmp_path: Path) -> None:
    db = tmp_path / "k.sqlite"
    store = _new_job(db, manifest)
    executor = connect_executor(RayConfig(address=cluster.address, steps_per_task=16))
    killed: list[int] = []
    result: dict[str, Any] = {}

    def run() -> None:
        result["final"] = run_epoch_job(store, "e", get_cost_model=_cost_model, executor=executor,
                                        num_workers=0, write_batch_steps=4)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not killed and thread.is_alive() and time.monotonic() < deadline:
        for pid in _ray_workers_running()[:1]:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.005)
    thread.join(timeout=120)
    executor.shutdown()
    store.close()
    assert killed, "no Ray worker was seen planning"
    assert result["final"].state == "done", result["final"].error
    assert result["final"].steps_done == NUM_STEPS
    assert executor.num_cluster_failures == 0  # Ray retried the task; the job never saw it
    assert _digests(db, "e") == pool_digests  # one row per step (primary key), the pool's bytes


def test_killed_driver_resumes_from_the_stored_steps(
        cluster: Any, manifest: Path, pool_digests: list[tuple[int, str]], tmp_path: Path) -> None:
    db = tmp_path / "d.sqlite"
    options = [a for k, v in FAST.items() if k != "time_limit_s" for a in ("--option", f"{k}={str(v).lower()}")]
    cmd = [sys.executable, "-m", "dcp_cli.main", "epoch", str(manifest), "--cluster", "h200x8",
           "--cost-model", COST_MODEL, "--out", str(db), "--samples-per-step", str(SAMPLES_PER_STEP),
           "--seed", str(SEED), "--time-limit-s", str(FAST["time_limit_s"]), "--epoch-id", "e",
           "--ray-address", cluster.address, "--ray-steps-per-task", "2", "--quiet", *options]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
    deadline = time.monotonic() + 60
    stored = 0
    while driver.poll() is None and time.monotonic() < deadline:
        if db.exists():
            try:
                stored = len(_digests(db, "e"))
            except sqlite3.OperationalError:
                stored = 0
            if stored:
                break
        time.sleep(0.01)
    driver.kill()
    _, err = driver.communicate(timeout=30)
    at_kill = len(_digests(db, "e"))
    assert 0 < stored <= at_kill < NUM_STEPS, (stored, at_kill, err.decode()[-2000:])
    # The restarted driver (here: this process) plans only the steps the store lacks.
    store = PlanStore.open(db)
    executor = connect_executor(RayConfig(address=cluster.address, steps_per_task=4))
    written: list[int] = []
    try:
        final = run_epoch_job(store, "e", get_cost_model=_cost_model, executor=executor, num_workers=0,
                              on_written=written.append)
    finally:
        executor.shutdown()
        store.close()
    assert final.state == "done" and final.steps_done == NUM_STEPS, final.error
    assert sum(written) == NUM_STEPS - at_kill
    assert _digests(db, "e") == pool_digests


def test_executor_runs_plan_step_only(cluster: Any) -> None:
    executor = RayStepExecutor(RayConfig(address=cluster.address))
    with pytest.raises(TypeError, match="plan_step"):
        executor.submit(print, "x")


def test_lost_cluster_fails_the_job_naming_it_and_keeps_the_steps(
        cluster: Any, manifest: Path, tmp_path: Path) -> None:
    """Runs last in this module (pytest keeps the file's order): it kills the module's cluster."""
    db = tmp_path / "l.sqlite"
    store = _new_job(db, manifest)
    executor = connect_executor(RayConfig(address=cluster.address, steps_per_task=2))
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(final=run_epoch_job(
        store, "e", get_cost_model=_cost_model, executor=executor, num_workers=0, write_batch_steps=2,
        requeue_transient=True)))
    thread.start()
    # Judged by progress, not by a deadline: the kill lands once 4 steps are stored.
    while (record := store.get_epoch("e")) is not None and record.steps_done < 4 and thread.is_alive():
        time.sleep(0.01)
    # Everything but the raylet this process (the driver) is attached to: Ray's core worker exits
    # its process on the first message to a dead local raylet ("Exiting because the Raylet IPC
    # connection failed"), which here would end pytest. The GCS is what the runner probes.
    own_node = ray.get_runtime_context().get_node_id()
    for node in cluster.list_all_nodes():
        for kind, processes in node.all_processes.items():
            for process in processes:
                if kind == "raylet" and node.node_id == own_node:  # ray_constants.PROCESS_TYPE_RAYLET
                    victims = child_pids(process.process.pid)  # its workers, not itself
                else:
                    victims = [process.process.pid]
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    # Judged by the outcome, not by how soon: Ray's driver waits a year for a lost GCS
    # (GCS_RECONNECT_TIMEOUT_S), so the job returns only because the runner fails it (a runner
    # that waited on the cluster instead would reach the test's timeout).
    thread.join()
    try:
        final = result["final"]
        assert final.state == "queued" and final.transient, final  # the service retries it with backoff
        assert cluster.address in final.error and "failed mid-job" in final.error
        assert 4 <= final.steps_done < NUM_STEPS
        assert len(_digests(db, "e")) == final.steps_done
        again = run_epoch_job(store, "e", get_cost_model=_cost_model, executor=executor, num_workers=0,
                              requeue_transient=True)
        assert again.state == "queued" and "unreachable" in (again.error or ""), again
        assert again.steps_done == final.steps_done
    finally:
        executor.shutdown()
        store.close()
