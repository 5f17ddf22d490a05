"""Running a doc page's bash blocks as a new user would: in order, in a fresh directory.

Each bash block of ``README.md`` and ``docs/*.md`` is preceded by ``<!-- doc-test: HOW -->``:

- ``run``: the page's own test runs it, with every other ``run`` block of the page, top to bottom
  as one shell session (so a server started with ``&`` in one block is stopped by ``kill %1`` where
  the page says), in a temporary directory holding only a link to ``examples/``;
- ``tests/NAME.py ...``: that test runs the block as written;
- ``like tests/NAME.py: why``: that test runs the same commands on other inputs;
- ``skip: why``: it cannot run in CI (installs, a Ray cluster).

A session fails on any failing command, and when a server it started is still running at its end.
Ports a page names (``8100``, ...) are replaced by free ones, and ``torchrun`` gets a free
rendezvous port, so pages run beside each other, other tests and a ``make run``; ``.venv/bin/``
becomes this interpreter's directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dcp_cli.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"(?:<!-- doc-test: ([^\n]*?) -->\n)?```bash\n(.*?)```", re.S)
PORT = re.compile(r"(?<=[: ])(8[0-9]00)\b")
TORCHRUN = re.compile(r"/torchrun (?!--standalone)")
STOPPED = ("for _ in $(seq 60); do [ -z \"$(jobs -rp)\" ] && break; sleep 0.5; done\n"
           "test -z \"$(jobs -rp)\" || { echo 'a server the page started is still running' >&2; exit 9; }\n")
"""The session's last lines: every server it started has stopped (a stopped one may take a moment)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """One bash block of a page: how it is tested, its text and its line."""

    how: str | None
    body: str
    line: int


def pages() -> list[Path]:
    """Every page whose bash blocks are tested: the README and docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The bash blocks of ``page`` in order."""
    text = page.read_text(encoding="utf-8")
    return [Block(how=m.group(1), body=m.group(2), line=text[:m.start()].count("\n") + 1)
            for m in BLOCK.finditer(text)]


def session(page: Path) -> str:
    """The page's ``run`` blocks as one script, in order."""
    return "\n".join(b.body for b in blocks(page) if b.how == "run")


def run_page(page: Path, cwd: Path, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``page``'s ``run`` blocks in ``cwd`` (a fresh directory) as one bash session.

    The session ends by failing if a background job it started is still alive; whatever happens,
    such jobs are killed on exit so that no server outlives the test.
    """
    (cwd / "examples").symlink_to(ROOT / "examples")
    script = session(page).replace(".venv/bin/", f"{BIN}/")
    ports = {port: str(free_port()) for port in sorted(set(PORT.findall(script)))}
    script = PORT.sub(lambda m: ports[m.group(1)], script)
    # torchrun's default rendezvous port (29500) is shared by every test beside this one.
    script = TORCHRUN.sub(lambda m: f"{m.group(0)}--master-addr 127.0.0.1 --master-port {free_port()} ", script)
    wrapped = ("trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script + "\n" + STOPPED)
    env = {"COLUMNS": "80", "PATH": f"{BIN}:/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k in ("HOME", "PYTHONPATH", "OMP_NUM_THREADS", "LANG")}}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", wrapped], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


def written(cwd: Path) -> list[str]:
    """What a session left in ``cwd``, as paths git's ignore rules can be asked about (a
    directory as ``NAME/x``: a pattern ending in ``/`` matches directories only)."""
    return sorted(f"{p.name}/x" if p.is_dir() else p.name for p in cwd.iterdir() if p.name != "examples")


def not_ignored(paths: list[str]) -> list[str]:
    """The ``paths`` (relative to the repository root) that ``.gitignore`` does not cover."""
    return [p for p in paths if subprocess.run(["git", "check-ignore", "-q", "--no-index", p], cwd=ROOT,
                                                check=False).returncode != 0]
