"""One config file: ``dcp serve --config`` and ``dcp epoch --config`` read it, flags and ``DCP_*``
variables override it, ``dcp config show`` names the source of every value, and a key the file
should not have is an error naming it."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from pathlib import Path

import httpx
import pytest

from api.settings import Settings
from tests.cli_run import dcp_env, run_dcp, serving_config

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(240)


def _rows(output: str) -> dict[str, tuple[str, str]]:
    """``setting -> (value, source)`` from ``dcp config show``'s table."""
    rows = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in Settings.model_fields:
            rows[parts[0]] = (parts[1], " ".join(parts[2:]))
    return rows


def test_config_show_names_the_source_of_every_value(tmp_path: Path) -> None:
    (tmp_path / "dcp.toml").write_text('[service]\nport = 8123\nnum_workers = 3\nauth_token = "s3cret"\n'
                                       '[epoch]\ncluster = "h200x8"\n')
    result = run_dcp("config", "show", "--config", "dcp.toml", cwd=tmp_path, env=dcp_env(DCP_NUM_WORKERS="2"))
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout)
    assert rows["port"] == ("8123", "dcp.toml [service]")
    assert rows["num_workers"] == ("2", "DCP_NUM_WORKERS")  # the environment over the file
    assert rows["host"] == ("127.0.0.1", "default")
    assert rows["auth_token"] == ("set", "dcp.toml [service]") and "s3cret" not in result.stdout
    assert "--cluster" in result.stdout and "h200x8" in result.stdout


@pytest.mark.parametrize(("text", "named"), [
    ("[service]\nprot = 1\n", "prot"),
    ("[serivce]\nport = 1\n", "serivce"),
    ("port = 1\n", "port"),
    ("[service\n", "not valid TOML"),
])
def test_a_bad_config_file_is_an_error_naming_the_key(tmp_path: Path, text: str, named: str) -> None:
    (tmp_path / "dcp.toml").write_text(text)
    for args in (("config", "show", "--config", "dcp.toml"), ("serve", "--config", "dcp.toml")):
        result = run_dcp(*args, cwd=tmp_path)
        assert result.returncode == 2 and named in result.stderr, (args, result.stderr)
    assert not (tmp_path / "plans.sqlite").exists()


@pytest.mark.parametrize(("text", "named"), [
    ("[epoch]\nsamples-per-stp = 32\n", "samples-per-stp"),  # an unknown option
    ('[epoch]\nsamples-per-step = "ten"\n', "samples-per-step = 'ten'"),  # a wrong type
    ("[epoch]\nseed = 1.5\n", "seed = 1.5"),
])
def test_config_show_refuses_an_epoch_table_as_dcp_epoch_does(tmp_path: Path, text: str, named: str) -> None:
    """``dcp config show`` checks the [epoch] table as ``dcp epoch --config`` would read it, so a
    table it prints is one the command takes."""
    (tmp_path / "train.jsonl").write_text('{"id": "a", "tokens": 100}\n')
    (tmp_path / "dcp.toml").write_text(text)
    for args in (("config", "show", "--config", "dcp.toml"),
                 ("epoch", "train.jsonl", "--config", "dcp.toml", "--samples-per-step", "1")):
        result = run_dcp(*args, cwd=tmp_path)
        assert result.returncode == 2 and named in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "plans.sqlite").exists()


def test_epoch_reads_its_table_and_flags_win(tmp_path: Path) -> None:
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(ROOT.joinpath("examples/manifests/train.jsonl").read_text().splitlines(True)[:96]))
    (tmp_path / "dcp.toml").write_text('[epoch]\ncluster = "h200x8"\nsamples-per-step = 32\nout = "cfg.sqlite"\n'
                                       'max-steps = 2\nworkers = 1\ntime-limit-s = 1.0\n')
    result = run_dcp("epoch", "train.jsonl", "--config", "dcp.toml", "--max-steps", "1", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "cfg.sqlite")) as conn:
        assert conn.execute("SELECT steps_done, steps_total FROM epochs").fetchone() == (1, 3)
    (tmp_path / "bad.toml").write_text("[epoch]\nsamples-per-stp = 32\n")
    result = run_dcp("epoch", "train.jsonl", "--config", "bad.toml", cwd=tmp_path)
    assert result.returncode == 2 and "samples-per-stp" in result.stderr


def test_serve_runs_from_the_example_config(tmp_path: Path) -> None:
    shutil.copy(ROOT / "examples/dcp.toml", tmp_path / "dcp.toml")
    with serving_config(tmp_path, env=dcp_env(DCP_AUTH_TOKEN="tok")) as (base, ready):
        assert ready.json()["workers"] == 2  # num_workers from the file
        assert (tmp_path / "plans.sqlite").is_file()  # db_path from the file, relative to the cwd
        body = {"samples": [{"id": "a", "tokens": 4096}], "cluster": "h200x8",
                "cost_model_id": "analytic-llama-7b-h200-sxm"}
        url = f"{base}/v1/plans"
        assert httpx.post(url, json=body, timeout=60).status_code == 401  # the token from DCP_AUTH_TOKEN
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer tok"}, timeout=60).status_code == 200


def test_a_bad_setting_is_named_in_plain_words(tmp_path: Path) -> None:
    """A value a setting refuses: exit 2 naming the setting, the value and why, without pydantic's
    own text (its model name, error types, documentation link)."""
    (tmp_path / "dcp.toml").write_text('[service]\nport = "x"\n')
    cases = [(("config", "show"), dcp_env(DCP_NUM_WORKERS="abc"), "setting num_workers (got 'abc')"),
             (("config", "show", "--config", "dcp.toml"), None, "setting port (got 'x')"),
             (("serve", "--config", "dcp.toml"), None, "setting port (got 'x')")]
    for args, env, named in cases:
        result = run_dcp(*args, cwd=tmp_path, env=env)
        text = " ".join(result.stderr.split())
        assert result.returncode == 2 and named in text, (args, result.stderr)
        for pydantic_text in ("pydantic.dev", "validation error for", "type=", "Traceback"):
            assert pydantic_text not in text, (args, result.stderr)
    assert not (tmp_path / "plans.sqlite").exists()
