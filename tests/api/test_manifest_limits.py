"""Manifests that are no manifests: a file's lines are never echoed in the refusal, a huge single
line is refused after a bounded read, ``dcp epoch`` leaves no store behind when it refuses a
manifest, and transient deadline retries keep giving more room."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.job_manager import RetryPolicy
from api.settings import Settings
from planner.workload import MAX_MANIFEST_LINE_CHARS, bounded_lines, parse_manifest_lines

from .conftest import AUTH
from .test_cli_epoch import _dcp_epoch
from .test_routes import _epoch_body


class CountingText(io.StringIO):
    """A text file that counts the characters read from it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.chars_read = 0

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        line = super().readline(-1 if size is None else size)
        self.chars_read += len(line)
        return line


def test_a_huge_single_line_is_refused_after_a_bounded_read() -> None:
    fh = CountingText('{"id": "a", "tokens": 12}\n' + "x" * (20 * MAX_MANIFEST_LINE_CHARS))
    with pytest.raises(ValueError, match=r"m.jsonl:2: line longer than"):
        list(parse_manifest_lines(bounded_lines(fh, source="m.jsonl"), source="m.jsonl"))
    assert fh.chars_read <= MAX_MANIFEST_LINE_CHARS + 100
    # A line of exactly the limit (and its newline) is read.
    exact = '{"id": "b", "tokens": 7' + " " * (MAX_MANIFEST_LINE_CHARS - 24) + "}\n"
    assert len(exact) == MAX_MANIFEST_LINE_CHARS + 1
    assert [s.id for s in parse_manifest_lines(bounded_lines(io.StringIO(exact), source="m"), source="m")] == ["b"]


@pytest.mark.parametrize("content", ["424242\n", '"pid 424242"\n', '{"owner": "424242", "tokens": 1}\n'])
def test_a_file_that_is_no_manifest_is_refused_without_echoing_its_lines(
        client: TestClient, settings: Settings, content: str) -> None:
    (settings.data_dir / "plans.sqlite.lock").write_text(content)
    body = _epoch_body(epoch_id="lock", manifest_jsonl=None, manifest_path="plans.sqlite.lock")
    response = client.post("/v1/epochs", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert "424242" not in response.text and ":1:" in response.text, response.text


def test_a_huge_single_line_manifest_file_is_a_422(client: TestClient, settings: Settings) -> None:
    (settings.data_dir / "one.jsonl").write_text("[" + "1," * (4 * MAX_MANIFEST_LINE_CHARS) + "1]")
    body = _epoch_body(epoch_id="one", manifest_jsonl=None, manifest_path="one.jsonl")
    response = client.post("/v1/epochs", json=body, headers=AUTH)
    assert response.status_code == 422 and "line longer than" in response.text, response.text[:300]


def test_dcp_epoch_refusing_an_unplannable_sample_leaves_no_store(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "ok", "tokens": 1024}\n{"id": "giant", "tokens": 50000000}\n')
    out = tmp_path / "plans.sqlite"
    done = _dcp_epoch(manifest, out)
    assert done.returncode == 2 and "giant" in done.stderr, done.stderr[-500:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


def test_deadline_margins_keep_growing_until_the_retries_run_out() -> None:
    policy = RetryPolicy(deadline_margin_s=1.0, max_transient_retries=20)
    assert [policy.margin_s(a) for a in (6, 7, 10)] == [64.0, 128.0, 1024.0]  # past 64x
