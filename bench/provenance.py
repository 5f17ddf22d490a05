"""What every benchmark JSON records about its run: the command and the commit it ran at.

``bench/tables.py`` names the commit in each table it renders from a JSON; a JSON without one is
shown as "commit not recorded".
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def provenance() -> dict[str, Any]:
    """``{"command": ..., "git_commit": ...}``: the script's command line and ``git rev-parse
    --short HEAD`` (None outside a git checkout), with ``-dirty`` when tracked files differ."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, text=True, capture_output=True, check=False,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or None
    if commit is not None and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "git_commit": commit}


def default_out(name: str) -> Path:
    """Where a benchmark writes its JSON unless ``--out`` names a file: ``bench-out/<name>.json``
    in the working directory (ignored by git). A committed result is written by passing ``--out
    bench/results/<name>.json`` explicitly, so a plain run never replaces one."""
    return Path("bench-out") / f"{name}.json"
