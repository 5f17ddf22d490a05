"""The README's Trainer block runs as written: ``examples/train_hf_trainer.py`` under torchrun, 4 gloo
ranks, plans made locally, the ``Trainer``'s logging and checkpoints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_cli.net import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


def _trainer_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Hugging Face Trainer and TRL\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_trainer_block_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    block = _trainer_block().replace(".venv/bin/", f"{BIN}/")
    assert "examples/train_hf_trainer.py" in block
    block = block.replace("torchrun ", f"torchrun --master-addr 127.0.0.1 --master-port {free_port()} ")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, capture_output=True,
                            text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) == 4, result.stdout
    assert losses[-1] < losses[0]  # it trains
    assert "done: 4 steps on 4 ranks (local plans)" in result.stdout
    for step in (2, 4):  # the Trainer's own checkpoints (save_steps=2)
        assert (tmp_path / "runs" / "hf-trainer" / f"checkpoint-{step}" / "trainer_state.json").is_file()
