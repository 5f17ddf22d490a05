"""The Trainer blocks of docs/training.md run as written: ``examples/train_hf_trainer.py`` and
``examples/train_trl_sft.py`` under torchrun, 4 gloo ranks, plans made locally, the ``Trainer``'s
logging and checkpoints; with ``--service``, the example's
measured step times reach a real ``dcp serve`` without measurement code in the script."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dcp_cli.net import free_port
from tests.executor.service import Service

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


def _trainer_block(script: str = "examples/train_hf_trainer.py") -> str:
    """The bash block of docs/training.md's Trainer section that runs ``script``."""
    page = (ROOT / "docs" / "training.md").read_text()
    section = page.split("## Hugging Face Trainer and TRL\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S) if script in b]
    assert len(blocks) == 1, (script, blocks)
    return blocks[0]


def _run_block(block: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "examples").symlink_to(ROOT / "examples")
    block = block.replace(".venv/bin/", f"{BIN}/")
    block = block.replace("torchrun ", f"torchrun --master-addr 127.0.0.1 --master-port {free_port()} ")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, capture_output=True,
                            text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_trainer_block_runs_as_written(tmp_path: Path) -> None:
    result = _run_block(_trainer_block(), tmp_path)
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) == 4, result.stdout
    assert losses[-1] < losses[0]  # it trains
    assert "done: 4 steps on 4 ranks (local plans)" in result.stdout
    evals = [float(x) for x in re.findall(r"^eval after step \d+: eval_loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(evals) == 2 and evals[1] < evals[0], result.stdout  # eval_strategy='steps' (2, 4) under DCP
    for step in (2, 4):  # the Trainer's own checkpoints (save_steps=2)
        assert (tmp_path / "runs" / "hf-trainer" / f"checkpoint-{step}" / "trainer_state.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_trl_block_runs_as_written(tmp_path: Path) -> None:
    """``examples/train_trl_sft.py``: TRL's ``SFTTrainer`` script with its ``# [dcp]`` lines, 2 steps."""
    pytest.importorskip("trl")
    result = _run_block(_trainer_block("examples/train_trl_sft.py"), tmp_path)
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) == 2 and losses[1] < losses[0], result.stdout  # it trains
    assert "done: 2 steps on 4 ranks (local plans)" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_posts_measured_steps_to_the_service(service: Service, tmp_path: Path) -> None:
    """``examples/train_hf_trainer.py --service``: the script has no measurement code; DCPTrainer posts
    each rank's measured micro-batch times of every step to the recalibration route of a real
    ``dcp serve``, read back here through the route and from the service's SQLite store."""
    steps, epoch_id = 3, "hf-trainer-example-measured"
    source = (ROOT / "examples" / "train_hf_trainer.py").read_text()
    assert not any(name in source for name in ("executor.measure", "MeasurementReporter", "StepTimer",
                                                "open_reporting", "/measurements"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "examples" / "train_hf_trainer.py"), "--service",
           "--url", service.url, "--epoch-id", epoch_id, "--steps", str(steps),
           "--output-dir", str(tmp_path / "run")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert f"done: {steps} steps on 4 ranks (service plans)" in done.stdout

    report = httpx.get(f"{service.url}/v1/epochs/{epoch_id}/recalibration", timeout=10).json()
    assert report["measured_steps"] == steps, report
    micro_batches = {}
    for step in range(steps):
        plan = httpx.get(f"{service.url}/v1/epochs/{epoch_id}/steps/{step}", timeout=10).json()
        micro_batches[step] = sum(len(group["micro_batches"]) for group in plan["plan"]["groups"])
    # one prediction error per group and micro-batch: every group's measured times arrived
    assert {s["step"]: s["num_micro_batches"] for s in report["steps"]} == micro_batches, report["steps"]

    with sqlite3.connect(f"file:{service.db_path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT step, rank, times_s, peak_bytes FROM measurements WHERE epoch_id=? "
                            "ORDER BY step, rank", (epoch_id,)).fetchall()
    assert [(step, rank) for step, rank, _, _ in rows] == [(s, r) for s in range(steps) for r in range(4)]
    for step, rank, times_json, peak_bytes in rows:
        times_s = json.loads(times_json)
        assert times_s and all(0 < t < 60 for t in times_s), (step, rank, times_s)
        assert peak_bytes is None  # CPU: no allocator peak (StepTimer reads torch.cuda's on GPUs)
