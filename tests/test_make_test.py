"""``make test``: the ``alone`` part (tests that judge measured times with nothing beside them) runs
even when the two-worker part failed, and make still fails. Before, the second pytest command sat
on its own recipe line, which make skips after a failing line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_alone_part_runs_after_a_failure(tmp_path: Path) -> None:
    marker = tmp_path / "alone-ran"
    (tmp_path / "test_two_parts.py").write_text(
        "import pathlib\nimport pytest\n\n\n"
        "def test_fails_in_the_first_part() -> None:\n    assert False\n\n\n"
        "@pytest.mark.alone\n"
        f"def test_runs_in_the_alone_part() -> None:\n    pathlib.Path({str(marker)!r}).write_text('ran')\n")
    venv = Path(sys.executable).parent.parent
    # Without the plugins this file needs none of (schemathesis, hypothesis, anyio): each of the
    # four pytest processes make starts (two parts, two workers) would import them, ~20 s apiece
    # on a busy 2-core machine.
    plugins = "-p no:schemathesis -p no:hypothesispytest -p no:anyio"
    result = subprocess.run(
        ["make", "-C", str(ROOT), "test", f"VENV={venv}", "-o", "install-test", "-o", f"{venv}/.browser-installed",
         f"PYTEST_ARGS={tmp_path / 'test_two_parts.py'} -p no:cacheprovider {plugins}"],
        capture_output=True, text=True, check=False)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "1 failed" in result.stdout, result.stdout[-2000:]
    assert marker.read_text() == "ran", result.stdout[-2000:]
