"""Every ``bash`` block of README.md is tested, and the plain CLI blocks run here as written.

A block is preceded by ``<!-- readme-test: HOW -->``, HOW being:

- ``run``: this file runs the block as written (``.venv/bin/`` made this venv's), in a temporary
  directory holding a link to ``examples/``; any command failing fails the test;
- ``tests/NAME.py``: that test runs the block as written (the service block, the models block,
  the image commands);
- ``like tests/NAME.py: why``: the commands run there on other inputs (the reader's own data);
- ``skip: why``: it cannot run in CI (installs, a Ray cluster);
- ``todo: what``: not tested yet; ``test_no_block_is_left_todo`` fails naming each such block.

A new block without a marker fails ``test_every_block_says_how_it_is_tested``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"(?:<!-- readme-test: (.*?) -->\n)?```bash\n(.*?)```", re.S)


def _blocks() -> list[tuple[str | None, str, int]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(m.group(1), m.group(2), text[:m.start()].count("\n") + 1) for m in BLOCK.finditer(text)]


def test_every_block_says_how_it_is_tested() -> None:
    blocks = _blocks()
    assert len(blocks) >= 10
    for how, body, line in blocks:
        assert how is not None, f"README.md:{line}: a bash block without <!-- readme-test: ... -->:\n{body[:200]}"
        if how.startswith(("tests/", "like tests/")):
            name = how.removeprefix("like ").split(":")[0].split()[0]
            assert (ROOT / name).is_file(), f"README.md:{line}: {name} does not exist"
        elif how != "run":
            kind, _, why = how.partition(":")
            assert kind in ("skip", "todo") and why.strip(), f"README.md:{line}: unknown marker {how!r}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line", [line for how, _, line in _blocks() if how == "run"])
def test_cli_block_runs_as_written(line: int, tmp_path: Path) -> None:
    body = next(b for how, b, at in _blocks() if at == line)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = body.replace(".venv/bin/", f"{BIN}/")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=280, check=False)
    assert result.returncode == 0, f"README.md:{line}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert not list((ROOT / "report").glob("*.png")), "a README command wrote pictures into the source tree"


def test_no_block_is_left_todo() -> None:
    """Every README block runs somewhere (the last todo, the CPU profile, fit and plan, runs in
    tests/test_readme_cpu_tour.py since issue 23)."""
    todo = [f"README.md:{line}: {how}" for how, _, line in _blocks() if how and how.startswith("todo:")]
    assert not todo, "\n".join(todo)
