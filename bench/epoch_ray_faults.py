"""Faults of epoch jobs on Ray, on a simulated two-node cluster (issue 14): what each one costs.

Every case plans the same epoch (200 steps of 8 ``text`` samples on ``h200x8``) on a
``ray.cluster_utils.Cluster`` (head + one worker node, 1 CPU each), breaks something mid-job,
recovers the way an operator would, and checks the store: one row per step, every digest equal
to the process pool's for the same seed.

1. a Ray worker SIGKILLed while it plans (Ray re-runs the task);
2. the worker node killed (every process of it; Ray re-runs its tasks on the head);
3. ``dcp epoch --ray-address`` killed (-9), then run again (resumes from the stored steps);
4. ``dcp serve`` with ``DCP_RAY_ADDRESS`` killed (-9), then restarted (the job resumes);
5. the whole cluster lost mid-job (``dcp epoch`` fails naming it), a new cluster, run again;
6. an unreachable address at start (``dcp epoch`` refuses at once, naming it).

Run from the repository root (needs ``pip install -e '.[ray]'``)::

    .venv/bin/python bench/epoch_ray_faults.py     # ~3-4 minutes on 2 shared cores

It prints a table and writes ``--out`` (default ``bench-out/epoch_ray_faults.json``) (load average included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import default_out, provenance  # noqa: E402  (bench/, the script's folder, is on sys.path)

from api.jobs import prepare_epoch, run_epoch_job  # noqa: E402
from api.pool import make_executor  # noqa: E402
from api.store import PlanStore  # noqa: E402
from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from dcp_cli.net import free_port  # noqa: E402
from planner.epoch import BatchRule  # noqa: E402
from planner.workload import read_manifest  # noqa: E402

logger = logging.getLogger("epoch_ray_faults")

NUM_SAMPLES = 1600
SAMPLES_PER_STEP = 8
SEED = 5
OPTIONS: dict[str, Any] = {"time_limit_s": 30.0, "use_cpsat": False}
COST_MODEL = "analytic-llama-7b-h200-sxm"
STEPS_BEFORE_FAULT = 20


def _manifest(path: Path) -> None:
    lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    path.write_text("".join(json.dumps({"id": f"s{i}", "tokens": lengths[(i * 7) % 8]}) + "\n"
                            for i in range(NUM_SAMPLES)))


def _cost_model(_: str = COST_MODEL) -> Any:
    return default_cost_model_file("llama-7b", "h200-sxm")


def _new_job(db: Path, manifest: Path) -> PlanStore:
    store = PlanStore.open(db)
    prepare_epoch(store, epoch_id="e", samples=read_manifest(manifest),
                  rule=BatchRule(samples_per_step=SAMPLES_PER_STEP), seed=SEED, cluster=load_cluster("h200x8"),
                  cost_model=_cost_model(), options=OPTIONS, manifest_source=str(manifest))
    return store


def _rows(db: Path) -> list[tuple[int, str]]:
    try:
        with sqlite3.connect(db) as conn:
            return conn.execute("SELECT step, digest FROM plans WHERE epoch_id='e' ORDER BY step").fetchall()
    except sqlite3.Error:
        return []


def _wait_rows(db: Path, count: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := len(_rows(db))) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def _kill_node(node: Any) -> None:
    for processes in node.all_processes.values():
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.process.pid, signal.SIGKILL)


def _cli(manifest: Path, db: Path, address: str) -> list[str]:
    return [sys.executable, "-m", "dcp_cli.main", "epoch", str(manifest), "--cluster", "h200x8", "--cost-model",
            COST_MODEL, "--out", str(db), "--samples-per-step", str(SAMPLES_PER_STEP), "--seed", str(SEED),
            "--epoch-id", "e", "--time-limit-s", str(OPTIONS["time_limit_s"]), "--option", "use_cpsat=false",
            "--ray-address", address, "--ray-steps-per-task", "2", "--quiet"]


def _ray_workers_running() -> list[int]:
    """Pids of Ray workers whose process title says they plan steps now."""
    pids = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and Path(f"/proc/{entry}/cmdline").read_bytes().startswith(b"ray::plan_step_batch"):
                pids.append(int(entry))
    return pids


def _start_cluster() -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def in_process_case(cluster: Any, db: Path, manifest: Path, fault: Callable[[], None]) -> dict[str, Any]:
    """This process drives the job; ``fault`` runs once STEPS_BEFORE_FAULT steps are stored."""
    from api.ray_runner import RayConfig, connect_executor

    store = _new_job(db, manifest)
    executor = connect_executor(RayConfig(address=cluster.address, steps_per_task=4))
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(final=run_epoch_job(
        store, "e", get_cost_model=_cost_model, executor=executor, num_workers=0, write_batch_steps=4)))
    start = time.monotonic()
    thread.start()
    at_fault = _wait_rows(db, STEPS_BEFORE_FAULT)
    fault()
    fault_t = time.monotonic()
    thread.join(timeout=300)
    executor.shutdown()
    store.close()
    final = out["final"]
    return {"steps_at_fault": at_fault, "after_fault_s": time.monotonic() - fault_t,
            "total_s": time.monotonic() - start,
            "state": final.state, "error": final.error, "cluster_failures_seen": executor.num_cluster_failures}


def service_case(cluster: Any, tmp: Path, manifest: Path) -> dict[str, Any]:
    """``dcp serve`` with DCP_RAY_ADDRESS killed (-9) mid-job and restarted."""
    port = free_port()
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    env = {**os.environ, "DCP_DB_PATH": str(tmp / "c4.sqlite"), "DCP_DATA_DIR": str(data), "DCP_NUM_WORKERS": "1",
           "DCP_RAY_ADDRESS": cluster.address, "DCP_WRITE_BATCH_STEPS": "4"}
    url = f"http://127.0.0.1:{port}"

    def serve() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "dcp_cli.main", "serve", "--port", str(port), "--log-level",
                                 "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz").status_code == 200:
                    return proc
            time.sleep(0.2)
        raise RuntimeError("service not ready")

    proc = serve()
    start = time.monotonic()
    body = {"epoch_id": "e", "manifest_jsonl": manifest.read_text(), "batch": {"samples_per_step": SAMPLES_PER_STEP},
            "seed": SEED, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": OPTIONS}
    httpx.post(f"{url}/v1/epochs", json=body, timeout=60).raise_for_status()
    at_fault = _wait_rows(tmp / "c4.sqlite", STEPS_BEFORE_FAULT)
    status = httpx.get(f"{url}/v1/epochs/e").json()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    fault_t = time.monotonic()
    proc = serve()
    deadline = time.monotonic() + 300
    while (final := httpx.get(f"{url}/v1/epochs/e").json())["state"] in ("queued", "running") \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return {"case": "dcp serve kill -9, restart", "db": "c4.sqlite", "steps_at_fault": at_fault,
            "steps_per_s_before": status.get("steps_per_s"), "after_fault_s": time.monotonic() - fault_t,
            "total_s": time.monotonic() - start, "state": final["state"], "error": final["error"]}


def _store_check(db: Path, reference: list[tuple[int, str]]) -> dict[str, Any]:
    """Rows, distinct steps (the primary key makes them equal), digests against the pool's."""
    with sqlite3.connect(db) as conn:
        rows, distinct = conn.execute("SELECT count(*), count(DISTINCT step) FROM plans").fetchone()
        steps_done = conn.execute("SELECT steps_done FROM epochs WHERE id='e'").fetchone()[0]
    return {"rows": rows, "distinct_steps": distinct, "steps_done_counter": steps_done,
            "digests_equal_pool": _rows(db) == reference}


def run_cases(tmp: Path, manifest: Path) -> list[dict[str, Any]]:
    """Every fault case, in order (each on a fresh store)."""
    import ray

    cases: list[dict[str, Any]] = []
    cluster = _start_cluster()
    ray.init(address=cluster.address, log_to_driver=False)

    def kill_one_worker() -> None:
        deadline = time.monotonic() + 10
        while not (pids := _ray_workers_running()) and time.monotonic() < deadline:
            time.sleep(0.005)
        for pid in pids[:1]:
            os.kill(pid, signal.SIGKILL)

    row = in_process_case(cluster, tmp / "c1.sqlite", manifest, kill_one_worker)
    cases.append({"case": "Ray worker SIGKILLed mid-task", "db": "c1.sqlite", **row})
    worker_node = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
    row = in_process_case(cluster, tmp / "c2.sqlite", manifest, lambda: _kill_node(worker_node))
    cases.append({"case": "worker node killed mid-job", "db": "c2.sqlite", **row})
    ray.shutdown()
    cluster.shutdown()

    cluster = _start_cluster()
    db = tmp / "c3.sqlite"
    start = time.monotonic()
    driver = subprocess.Popen(_cli(manifest, db, cluster.address), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=ROOT)
    at_fault = _wait_rows(db, STEPS_BEFORE_FAULT)
    driver.kill()
    driver.wait()
    fault_t = time.monotonic()
    again = subprocess.run(_cli(manifest, db, cluster.address), capture_output=True, text=True, cwd=ROOT, check=False)
    cases.append({"case": "dcp epoch driver kill -9, run again", "db": "c3.sqlite", "steps_at_fault": at_fault,
                  "after_fault_s": time.monotonic() - fault_t, "total_s": time.monotonic() - start,
                  "state": "done" if again.returncode == 0 else f"rc {again.returncode}", "error": None})
    cases.append(service_case(cluster, tmp, manifest))

    db = tmp / "c5.sqlite"
    start = time.monotonic()
    orphan = subprocess.Popen(_cli(manifest, db, cluster.address), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    at_fault = _wait_rows(db, STEPS_BEFORE_FAULT)
    for node in cluster.list_all_nodes():
        _kill_node(node)
    fault_t = time.monotonic()
    _, err = orphan.communicate(timeout=300)
    failed_after_s = time.monotonic() - fault_t
    first_error = next((line for line in err.splitlines() if line.startswith("error:")), err[-300:])
    cluster.shutdown()
    cluster = _start_cluster()
    again = subprocess.run(_cli(manifest, db, cluster.address), capture_output=True, text=True, cwd=ROOT, check=False)
    cases.append({"case": "whole cluster lost; new cluster, run again", "db": "c5.sqlite", "steps_at_fault": at_fault,
                  "first_run_failed_after_s": failed_after_s, "first_run_rc": orphan.returncode,
                  "error": first_error.strip(), "after_fault_s": time.monotonic() - fault_t,
                  "total_s": time.monotonic() - start,
                  "state": "done" if again.returncode == 0 else f"rc {again.returncode}"})
    cluster.shutdown()

    start = time.monotonic()
    refused = subprocess.run(_cli(manifest, tmp / "c6.sqlite", f"127.0.0.1:{free_port()}"), capture_output=True,
                             text=True, cwd=ROOT, check=False)
    cases.append({"case": "unreachable address at start", "db": None, "state": f"rc {refused.returncode}",
                  "total_s": time.monotonic() - start, "store_created": (tmp / "c6.sqlite").exists(),
                  "error": " ".join(refused.stderr.replace("│", " ").split())[-300:]})
    return cases


def main(argv: list[str] | None = None) -> None:
    """Run every fault case, print the table and write the results JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=default_out("epoch_ray_faults"), help="JSON output.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dcprf", dir="/tmp") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "ray").mkdir()
        os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(tmp / "ray")})
        manifest = tmp / "m.jsonl"
        _manifest(manifest)
        store = _new_job(tmp / "pool.sqlite", manifest)
        pool = make_executor(2)
        run_epoch_job(store, "e", get_cost_model=_cost_model, executor=pool, num_workers=2)
        pool.shutdown(wait=True)
        store.close()
        reference = _rows(tmp / "pool.sqlite")
        cases = run_cases(tmp, manifest)
        for case in cases:
            db = case.pop("db")
            if db is not None:
                case.update(_store_check(tmp / db, reference))
    total = len(reference)
    print(f"\nRay fault cases: {total} steps, 2 simulated nodes x 1 CPU; load {load_start}")
    print(f"{'case':<44} {'at fault':>8} {'recovered s':>11} {'state':>7} {'rows':>5} {'steps':>5} {'digests':>8}")
    for c in cases:
        print(f"{c['case']:<44} {c.get('steps_at_fault', '-')!s:>8} {c.get('after_fault_s', c['total_s']):>11.1f} "
              f"{c['state']:>7} {c.get('rows', '-')!s:>5} {c.get('distinct_steps', '-')!s:>5} "
              f"{('equal' if c['digests_equal_pool'] else 'DIFFER') if 'digests_equal_pool' in c else '-':>8}")
        if c.get("error"):
            print(f"    {c['error'][:200]}")
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"loadavg_start": load_start, "loadavg_end": os.getloadavg(), "steps": total,
              "samples_per_step": SAMPLES_PER_STEP, "options": OPTIONS, "cases": cases}
    out.write_text(json.dumps({**provenance(), **record}, indent=1) + "\n")
    logger.warning("wrote %s", out)


if __name__ == "__main__":
    main()
