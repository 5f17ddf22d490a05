"""An output path in a directory that does not exist is refused (exit 2, naming the option and the
directory) by every command that writes one, and nothing is created: a mistyped ``--out`` used to
make the whole tree, wherever it pointed (``/`` included)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [
    ["manifest", "--workload", "video-short", "--num-samples", "4", "-q", "--out", "{out}/m.jsonl"],
    ["epoch", str(ROOT / "examples/manifests/train.jsonl"), "--samples-per-step", "8", "--out", "{out}/p.sqlite"],
    ["report", "epoch", "plans.sqlite", "--epoch", "e0", "--out-dir", "{out}/pictures"],
    ["fit", "no-such-profile.jsonl", "--out", "{out}/cm.json"],
    ["profile", "--model", "tiny", "--out", "{out}/p.jsonl"],
    ["check-model", "--out", "{out}/r.json"],
])
def test_an_output_in_a_missing_directory_is_refused(tmp_path: Path, command: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no" / "such"
    args = [a.replace("{out}", str(missing)) for a in command]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    text = " ".join(result.output.split())
    assert result.exit_code == 2, (args, result.output)
    assert f"the directory {missing}" in text and "does not exist" in text, (args, result.output)
    assert not (tmp_path / "no").exists()
