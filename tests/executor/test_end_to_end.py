"""End to end: ``dcp serve`` in a subprocess, ``examples/train_*.py`` under torchrun (4 ranks)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_cli.net import free_port
from tests.executor.service import Service

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
# train_1d.py runs once, as a ring epoch: its Ulysses path is the one train_2d.py and
# train_hf_llama.py run here (and the spawned worlds check exactly); a second torchrun of it cost
# 12 s of the suite's 15-minute budget.
@pytest.mark.parametrize(("script", "extra"), [("train_1d.py", ["--layout", "ring"]),
                                               ("train_2d.py", []),
                                               ("train_hf_llama.py", ["--grad-sync", "fsdp2"]),
                                               ("train_hf_latte.py", []), ("train_hf_wan.py", [])])
def test_example_trains_under_torchrun_with_served_plans(service: Service, script: str,
                                                         extra: list[str]) -> None:
    if script == "train_hf_llama.py":
        pytest.importorskip("transformers")
    if script in ("train_hf_latte.py", "train_hf_wan.py"):
        pytest.importorskip("diffusers")
    steps = 3
    layout = extra[extra.index("--layout") + 1] if "--layout" in extra else None
    epoch_id = f"e2e-{Path(script).stem}" + (f"-{layout}" if layout else "")  # one epoch per case: shared service
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(ROOT / "examples" / script), "--url", service.url, "--steps", str(steps),
           "--num-samples", "32", "--samples-per-step", "8", "--epoch-id", epoch_id, *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", done.stdout, re.MULTILINE)]
    assert len(losses) == steps, done.stdout
    assert all(0 < loss < 100 for loss in losses)
    assert f"done: {steps} steps of epoch {epoch_id} on 4 ranks" in done.stdout
    if layout == "ring":  # every group of 2 or more ranks ran as a ring (the epoch declared them)
        groups = re.findall(r"^step \d+: .* group sizes (\[[0-9, ]+\]) ring degrees (\[[0-9, ]+\])",
                            done.stdout, re.MULTILINE)
        assert len(groups) == steps, done.stdout
        assert all(json.loads(sizes) == json.loads(rings) for sizes, rings in groups), groups
        assert any(max(json.loads(rings)) > 1 for _, rings in groups), groups
