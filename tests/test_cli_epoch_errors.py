"""``dcp epoch``: bad input is refused naming the option, before the store file is created."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app

pytestmark = pytest.mark.timeout(120)

runner = CliRunner(env={"COLUMNS": "250"})


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["epoch", *args])
    return result.exit_code, " ".join(result.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"id": "s{i}", "tokens": {512 * (i % 7 + 1)}}}\n' for i in range(12)))
    return path


def test_bad_inputs_name_the_option_and_create_no_store(tmp_path: Path, manifest: Path) -> None:
    out = tmp_path / "plans.sqlite"
    cases = [
        ([], "one of --samples-per-step N or --tokens-per-step N"),
        (["--samples-per-step", "4", "--tokens-per-step", "4096"], "one of --samples-per-step"),
        (["--samples-per-step", "0"], "--samples-per-step"),
        (["--samples-per-step", "4", "--cost-model", "nosuch"],
         "--cost-model 'nosuch' is not an embedded cost model"),
        (["--samples-per-step", "4", "--cluster", "nope"], "--cluster: unknown cluster preset 'nope'"),
        (["--samples-per-step", "4", "--option", "nokeyvalue"], "--option 'nokeyvalue' is not KEY=VALUE"),
    ]
    for args, message in cases:
        code, output = _run(str(manifest), "--out", str(out), *args)
        assert code == 2, output
        assert message in output, output
        assert "/v1/" not in output  # no HTTP route in a CLI message
        assert not out.exists(), args
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": 0}\n')
    code, output = _run(str(bad), "--out", str(out), "--samples-per-step", "4")
    assert code == 2 and "bad.jsonl:1: tokens" in output and not out.exists()


def test_summary_is_formatted(tmp_path: Path, manifest: Path) -> None:
    out = tmp_path / "plans.sqlite"
    code, output = _run(str(manifest), "--out", str(out), "--samples-per-step", "6", "--workers", "1",
                        "--option", "use_cpsat=false", "-q")
    assert code == 0, output
    assert "done, 2/2 steps" in output
    assert re.search(r"mean gap to the lower bound \d+\.\d\d%", output), output
    assert re.search(r"mean predicted speedup over the strongest baseline \d+\.\d\dx in 2 of 2 steps \(over "
                     r"bucket-sp4, the DCP paper's baseline: \d+\.\d\dx in 2 of 2 steps\)", output), output
    # Stored under a model the store now knows: a second run finds it done.
    code, output = _run(str(manifest), "--out", str(out), "--samples-per-step", "6", "--workers", "1",
                        "--option", "use_cpsat=false")
    assert code == 0 and "already stored" in output
