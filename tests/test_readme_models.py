"""The README's model block runs as written (``--model-config`` in dcp cost, plan, epoch and
profile, ``--model`` with a new preset), and says what the section promises."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.timeout(300)


def _models_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Models\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


def test_readme_models_block_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # dcp profile
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    block = _models_block().replace(".venv/bin/", f"{BIN}/")
    for option in ("--model-config", "--model "):
        assert option in block
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path,
                            env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                            timeout=280, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    # dcp cost of Llama-3.1-8B: group sizes 16 and 32, past its 8 KV heads.
    sizes = [int(line.split()[0]) for line in out.split("131,072 tokens", 1)[1].split("Columns:", 1)[0].splitlines()
             if line.strip()[:1].isdigit()]
    assert sizes == [1, 2, 4, 8, 16, 32]
    assert out.count("dcp plan: ") == 2 and "epoch videos-s0: done, 8/8 steps" in out
    with sqlite3.connect(tmp_path / "video-plans.sqlite") as conn:
        spec = json.loads(conn.execute("SELECT spec FROM epochs").fetchone()[0])
    assert spec["model"]["name"] == "wan2.1-1.3b" and spec["model"]["kind"] == "3d"
    header = json.loads((tmp_path / "qwen3.jsonl").read_text().splitlines()[0])
    assert header["model"]["name"] == "qwen3-8b" and header["profiled"]["hidden"] == 128
