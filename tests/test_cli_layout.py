"""The attention layout from the command line: ``dcp plan --layout``, ``dcp epoch --layout`` and its
``[epoch] layout`` key, the service's ``[service] plan_layout`` setting (``dcp serve --config``,
``dcp config show``); bad values stop with exit code 2 naming the option."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from dcp_cli.main import app
from tests.cli_run import run_dcp, serving_config

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(240)


def _plan_json(*extra: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["plan", "-w", "text-millionctx", "-c", "h200x64", "-k", "1", "-b", "16",
                                      "--budget-ms", "20", "--json", "-q", *extra])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def _one_step(report: dict[str, Any]) -> dict[str, Any]:
    (row,) = report["steps"]
    return dict(row)


def test_dcp_plan_layout() -> None:
    auto = _plan_json("--layout", "auto")
    assert auto["layout"] == "auto"
    row = _one_step(auto)
    assert any(r > 1 for _, _, r in row["layouts"]), row["layouts"]
    assert sorted(d for d, _, _ in row["layouts"]) == sorted(row["group_sizes"])
    for d, u, r in row["layouts"]:
        assert u * r == d
    assert _one_step(_plan_json())["layouts"] == row["layouts"]  # auto is the default
    plain = _one_step(_plan_json("--layout", "ulysses"))
    assert all(r == 1 and d <= 32 for d, _, r in plain["layouts"])  # Llama-3.1-8B: 32 query heads
    table = CliRunner().invoke(app, ["plan", "-w", "text-millionctx", "-c", "h200x64", "-k", "1", "-b", "16",
                                     "--budget-ms", "20", "-q", "--layout", "ring"])
    assert table.exit_code == 0, table.output
    assert "[1*" in table.stdout  # a pure ring shows its degrees: 8[1*8]
    bad = CliRunner().invoke(app, ["plan", "-w", "text-longtail", "-c", "h200x8", "--layout", "spiral"])
    assert bad.exit_code == 2 and "--layout 'spiral' is not one of" in bad.output
    video = CliRunner().invoke(app, ["plan", "-w", "video-short", "-c", "h200x8", "-k", "1", "-b", "8",
                                     "--layout", "ring"])
    assert video.exit_code == 2 and "a ring cannot split" in " ".join(video.output.split()), video.output


def _spec(db: Path) -> dict[str, Any]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(json.loads(conn.execute("SELECT spec FROM epochs").fetchone()[0]))


def test_dcp_epoch_layout_flag_and_config_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planning runs in this process (``dcp epoch`` as a user runs it, in a process of its own,
    is tested in test_cli_config.py and by the doc pages); the refused config in a ``dcp`` process."""
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(ROOT.joinpath("examples/manifests/train.jsonl").read_text().splitlines(True)[:64]))
    monkeypatch.chdir(tmp_path)  # relative --out and [epoch] out, as run from the directory
    common = ("--cluster", "h200x8", "--samples-per-step", "32", "--max-steps", "1", "--workers", "1", "-q")

    def epoch(*args: str) -> None:
        result = CliRunner().invoke(app, ["epoch", "train.jsonl", *common, *args])
        assert result.exit_code == 0, result.output

    epoch("--layout", "ring", "--out", "flag.sqlite")
    spec = _spec(tmp_path / "flag.sqlite")
    assert spec["options"]["layout"] == "ring"
    # llama-7b (32 heads) on 8 ranks: every size a pure ring
    assert spec["layouts"] == [[d, 1, d] for d in (1, 2, 4, 8)]
    (tmp_path / "dcp.toml").write_text('[epoch]\nlayout = "auto"\nout = "cfg.sqlite"\n')
    epoch("--config", "dcp.toml")
    spec = _spec(tmp_path / "cfg.sqlite")
    assert spec["options"]["layout"] == "auto"
    assert spec["layouts"] == [[1, 1, 1], [2, 1, 2], [2, 2, 1], [4, 1, 4], [4, 4, 1], [8, 1, 8], [8, 8, 1]]
    epoch("--out", "plain.sqlite")
    # the default, auto, stored explicitly (a job stored without a layout plans as ulysses)
    plain = _spec(tmp_path / "plain.sqlite")
    assert plain["options"]["layout"] == "auto" and plain["layouts"] == spec["layouts"]
    (tmp_path / "bad.toml").write_text('[epoch]\nlayout = "spiral"\nout = "bad.sqlite"\n')
    result = run_dcp("epoch", "train.jsonl", *common, "--config", "bad.toml", cwd=tmp_path)
    assert result.returncode == 2 and "--layout 'spiral' is not one of" in result.stderr, result.stderr
    assert not (tmp_path / "bad.sqlite").exists()


def test_service_plan_layout_from_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "dcp.toml").write_text('[service]\nplan_layout = "auto"\nnum_workers = 1\n')
    shown = run_dcp("config", "show", "--config", "dcp.toml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert any(line.split()[:3] == ["plan_layout", "auto", "dcp.toml"] for line in shown.stdout.splitlines()), \
        shown.stdout
    (tmp_path / "bad.toml").write_text('[service]\nplan_layout = "spiral"\n')
    bad = run_dcp("config", "show", "--config", "bad.toml", cwd=tmp_path)
    assert bad.returncode == 2 and "plan_layout" in bad.stderr, bad.stderr
    with serving_config(tmp_path) as (url, _):
        # 4M tokens fit no Ulysses group of Llama-3.1-8B (2M do, with the loss in chunks): the
        # request names no layout and the service's default (auto) plans it on a ring
        samples = [{"id": "huge", "tokens": 4 * 1024 * 1024}, {"id": "a", "tokens": 8192}]
        body = {"samples": samples, "cluster": "h200x64", "model": "llama-3.1-8b",
                "options": {"time_limit_s": 5.0, "use_cpsat": False}}
        response = httpx.post(f"{url}/v1/plans", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert any(g.get("ring_degree", 1) > 1 for g in response.json()["plan"]["groups"])
        body["options"] = {"time_limit_s": 5.0, "use_cpsat": False, "layout": "ulysses"}
        refused = httpx.post(f"{url}/v1/plans", json=body, timeout=120)
        assert refused.status_code == 422 and "fits nowhere" in refused.text, refused.text
