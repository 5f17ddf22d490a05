"""A running epoch job never sits without progress for longer than its bound: a job whose steps
cannot finish (its only solver worker stopped with SIGSTOP, steps without a deadline, so the pool
has nothing to enforce) is stopped and retried, and after its retries it is ``failed`` with the
reason, on a real store and a real pool."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from api.job_manager import JobManager, RetryPolicy
from api.jobs import prepare_epoch
from api.pool import SolverPool
from api.store import PlanStore
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.schema import CostModelFile
from planner.epoch import BatchRule
from planner.workload import read_manifest

from .conftest import FAST, manifest_lines

pytestmark = pytest.mark.timeout(300)


def _cost_model(_: str) -> CostModelFile:
    return default_cost_model_file("llama-7b", "h200-sxm")


def test_a_job_without_progress_is_restarted_then_failed_with_the_reason(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_lines(64))
    store = PlanStore.open(tmp_path / "plans.sqlite")
    prepare_epoch(store, epoch_id="e", samples=read_manifest(manifest), rule=BatchRule(samples_per_step=8),
                  seed=1, cluster=load_cluster("h200x8"), cost_model=_cost_model(""), options=FAST,
                  manifest_source=str(manifest))
    pool = SolverPool(1)
    jobs = JobManager(store, get_cost_model=_cost_model, executor=pool, num_workers=1, write_batch_steps=1,
                      retry=RetryPolicy(deadline_margin_s=None, stall_floor_s=2.0, max_transient_retries=1,
                                        first_backoff_s=0.1))
    deadline = time.monotonic() + 120
    while not pool.health().ok:
        assert time.monotonic() < deadline, pool.health()
        time.sleep(0.05)
    (worker,) = pool.worker_pids()
    os.kill(worker, signal.SIGSTOP)  # alive, holding its task, never answering
    try:
        jobs.start("e")
        deadline = time.monotonic() + 180
        while (record := store.get_epoch("e")) is not None and record.state != "failed":
            assert time.monotonic() < deadline, record
            time.sleep(0.1)
        assert record is not None and record.error is not None
        assert "no step stored" in record.error and "gave up after 1 retries" in record.error, record.error
        assert record.steps_done == 0
    finally:
        os.kill(worker, signal.SIGKILL)
        jobs.shutdown(timeout_s=10)
        pool.shutdown(wait=True, kill_running=True)
        store.close()
