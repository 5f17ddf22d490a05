"""Each ``dcp`` command imports what it needs when it runs: help, ``dcp config show`` and a config
file refused by ``dcp epoch`` or ``dcp serve`` load neither the solver, the numeric stack, torch
nor the web framework (each of those costs seconds of start-up on a busy machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_run import dcp_env

HEAVY = ("torch", "ortools", "scipy", "numpy", "pandas", "fastapi", "uvicorn", "matplotlib", "transformers",
         "ray")
"""Top-level packages none of the light commands may import."""

LIGHT_COMMANDS = [
    (["--help"], 0),
    (["plan", "--help"], 0),
    (["epoch", "--help"], 0),
    (["config", "show"], 0),
    (["config", "show", "--config", "ok.toml"], 0),
    (["epoch", "train.jsonl", "--config", "bad-epoch.toml", "--samples-per-step", "1"], 2),
    (["serve", "--config", "bad-service.toml"], 2),
]
"""Commands run in this order in one interpreter, with their exit codes."""


@pytest.mark.timeout(120)
def test_light_commands_do_not_import_the_solver_or_the_service(tmp_path: Path) -> None:
    (tmp_path / "ok.toml").write_text('[service]\nport = 8123\n[epoch]\ncluster = "h200x8"\n')
    (tmp_path / "bad-epoch.toml").write_text("[epoch]\nseed = 1.5\n")
    (tmp_path / "bad-service.toml").write_text("[service]\nprot = 1\n")
    (tmp_path / "train.jsonl").write_text('{"id": "a", "tokens": 100}\n')
    # One fresh interpreter runs the commands in turn, printing after each the exit code and the
    # heavy packages imported so far (a package imported by one command stays listed after it).
    code = (
        "import json, sys\n"
        "from dcp_cli.main import app\n"
        f"for args, _ in {LIGHT_COMMANDS!r}:\n"
        "    try:\n"
        "        app(args, prog_name='dcp')\n"
        "        code = 0\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        f"    heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "    print('RESULT ' + json.dumps([args, code, heavy]), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dcp_env(), capture_output=True,
                            text=True, timeout=100, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line.removeprefix("RESULT ")) for line in result.stderr.splitlines()
            if line.startswith("RESULT ")]
    assert [(args, code) for args, code, _ in rows] == [(args, code) for args, code in LIGHT_COMMANDS], \
        result.stderr[-4000:]
    for args, _, heavy in rows:
        assert heavy == [], f"dcp {' '.join(args)} imported {heavy}"
    assert not (tmp_path / "plans.sqlite").exists()
