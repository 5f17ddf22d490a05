"""The CLI applies the service's limits (``planner.limits``) and checks every input before it
writes anything: exit 2 with a message naming the option or the sample, bytes in binary units."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app
from planner.limits import MAX_MANIFEST_SAMPLES, MAX_SAMPLES_PER_REQUEST
from planner.workload import read_manifest

pytestmark = pytest.mark.timeout(120)

runner = CliRunner(env={"COLUMNS": "250"})


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def test_plan_batch_size_over_the_limit_is_refused_at_once() -> None:
    code, out = _run("plan", "-w", "text-longtail", "-c", "h200x8", "-b", "100000000", "-q")
    assert code == 2 and f"--batch-size 100,000,000 is outside 1..{MAX_SAMPLES_PER_REQUEST:,}" in out, out


def test_manifest_num_samples_over_the_limit_is_refused(tmp_path: Path) -> None:
    out_file = tmp_path / "m.jsonl"
    code, out = _run("manifest", "--workload", "text-longtail", "--num-samples", "999999999999",
                     "-o", str(out_file), "-q")
    assert code == 2 and f"--num-samples 999,999,999,999 samples is outside 1..{MAX_MANIFEST_SAMPLES:,}" in out
    assert not out_file.exists()


def test_skip_invalid_skips_duplicate_ids(tmp_path: Path) -> None:
    table = tmp_path / "t.csv"
    table.write_text("id,tokens\na,5\nb,7\na,9\nc,0\n")
    out_file = tmp_path / "t.jsonl"
    code, out = _run("manifest", str(table), "-o", str(out_file))
    assert code == 2 and "sample id 'a' appears twice" in out and not out_file.exists()
    code, out = _run("manifest", str(table), "-o", str(out_file), "--skip-invalid")
    assert code == 0, out
    assert [(s.id, s.tokens) for s in read_manifest(out_file)] == [("a", 5), ("b", 7)]
    assert "skipped 2 bad row(s)" in out, out


def test_a_string_number_is_refused_as_the_api_refuses_it(tmp_path: Path) -> None:
    manifest = tmp_path / "s.jsonl"
    manifest.write_text('{"id": "a", "tokens": "12"}\n')
    store = tmp_path / "plans.sqlite"
    code, out = _run("epoch", str(manifest), "--samples-per-step", "1", "--out", str(store))
    # The refusal names the line, the field and the JSON type it got, never the file's text.
    assert code == 2 and "s.jsonl:1: tokens: Input should be a valid integer (got a JSON string)" in out, out
    assert "'12'" not in out, out
    assert not store.exists()


def test_epoch_refuses_a_sample_that_fits_nowhere_before_writing(tmp_path: Path) -> None:
    manifest = tmp_path / "big.jsonl"
    manifest.write_text('{"id": "ok", "tokens": 4096}\n{"id": "monster", "tokens": 40000000}\n')
    store = tmp_path / "plans.sqlite"
    code, out = _run("epoch", str(manifest), "--samples-per-step", "2", "--out", str(store), "-q")
    assert code == 2, out
    assert "sample 'monster' (40,000,000 tokens) fits nowhere" in out, out
    assert " TiB of activations per rank, over the limit of " in out and " GiB" in out, out
    assert "e+" not in out  # no 1.03732e+11 bytes
    assert not store.exists()


def test_epoch_out_must_be_a_sqlite_file(tmp_path: Path) -> None:
    manifest = tmp_path / "t.jsonl"
    manifest.write_text('{"id": "a", "tokens": 512}\n{"id": "b", "tokens": 1024}\n')
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    code, out = _run("epoch", str(manifest), "--samples-per-step", "2", "--out", str(text), "-q")
    assert code == 2 and "is not a SQLite file" in out, out
    assert text.read_text() == "not a database\n"
    code, out = _run("epoch", str(manifest), "--samples-per-step", "2", "--out", str(tmp_path), "-q")
    assert code == 2 and "is a directory" in out, out
    code, out = _run("epoch", str(manifest), "--samples-per-step", str(MAX_SAMPLES_PER_REQUEST + 1),
                     "--out", str(tmp_path / "p.sqlite"), "-q")
    assert code == 2 and "--samples-per-step 16,385 is over the service's limit" in out, out
    assert not (tmp_path / "p.sqlite").exists()
