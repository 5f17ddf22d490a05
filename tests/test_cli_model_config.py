"""``--model-config`` beside ``--model`` in ``dcp cost``, ``dcp plan`` and ``dcp epoch``; a manifest
or shape of the other kind than the model is refused naming the sample, before anything is written."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
LLAMA31 = ROOT / "examples" / "configs" / "llama-3.1-8b" / "config.json"
runner = CliRunner(env={"COLUMNS": "250"})


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def test_cost_from_a_llama31_config_lists_groups_past_the_kv_heads() -> None:
    code, output = _run("cost", "131072", "--model-config", str(LLAMA31), "--cluster", "h200x64", "--json")
    assert code == 0, output
    payload = json.loads(runner.invoke(app, ["cost", "131072", "--model-config", str(LLAMA31), "--cluster",
                                             "h200x64", "--json"]).output)
    assert payload["cost_model_id"] == "analytic-llama-3.1-8b-h200-sxm"
    assert [r["group_size"] for r in payload["rows"]] == [1, 2, 4, 8, 16, 32]


def test_cost_refuses_both_a_bad_config_and_the_other_kind(tmp_path: Path) -> None:
    code, output = _run("cost", "1024", "--model", "llama-7b", "--model-config", str(LLAMA31))
    assert code == 2 and "give one of --model and --model-config, not both" in output, output
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**json.loads(LLAMA31.read_text()), "num_key_value_heads": 5}))
    code, output = _run("cost", "1024", "--model-config", str(bad))
    assert code == 2 and f"{bad}: num_attention_heads=32 is not divisible by num_key_value_heads=5" in output
    code, output = _run("cost", "1024", "2x3x4", "--model-config", str(LLAMA31))
    assert code == 2 and "sample 'shape1' (#1) is a video sample (2x3x4" in output and "TOKENS" in output
    code, output = _run("cost", "1024", "--model", "wan2.1-1.3b")
    assert code == 2 and "kind '3d'" in output and "FRAMESxHEIGHTxWIDTH" in output, output


def test_plan_from_a_config_and_its_errors() -> None:
    code, output = _run("plan", "--model-config", str(LLAMA31), "-w", "text-longtail", "-c", "h200x64",
                        "-k", "1", "-b", "64", "--json", "-q")
    assert code == 0, output
    result = runner.invoke(app, ["plan", "--model-config", str(LLAMA31), "-w", "text-longtail", "-c", "h200x64",
                                 "-k", "1", "-b", "64", "--json", "-q"])
    steps = json.loads(result.output)["steps"]
    assert len(steps) == 1 and sum(steps[0]["group_sizes"]) == 64
    code, output = _run("plan", "--model", "wan2.1-1.3b", "-w", "text-longtail", "-c", "h200x64", "-k", "1", "-q")
    assert code == 2 and "workload 'text-longtail' (1d): sample" in output and "kind '3d'" in output, output
    code, output = _run("plan", "--model", "llama-3.1-8b", "--model-config", str(LLAMA31), "-w", "text-longtail",
                        "-c", "h200x64", "-q")
    assert code == 2 and "not both" in output


def test_cost_of_a_3d_model_is_quadratic_in_a_clips_tokens() -> None:
    result = runner.invoke(app, ["cost", "21x45x80", "42x45x80", "--model", "wan2.1-1.3b", "--cluster", "h200x64",
                                 "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["frames"], r["group_size"]): r["time_s_none"] for r in json.loads(result.output)["rows"]}
    # 75,600 vs 151,200 tokens: attention over the whole clip makes twice the tokens cost over twice.
    assert rows[(42, 4)] > 2.2 * rows[(21, 4)]


def _write(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_epoch_models_and_manifest_kinds(tmp_path: Path) -> None:
    text = _write(tmp_path / "text.jsonl", [{"id": f"t{i}", "tokens": 512 * (i % 5 + 1)} for i in range(12)])
    video = _write(tmp_path / "video.jsonl", [{"id": f"v{i}", "frames": 1 + i % 3, "height": 9, "width": 16}
                                              for i in range(12)])
    out = tmp_path / "plans.sqlite"
    common = ["--out", str(out), "--samples-per-step", "6", "--workers", "1", "--option", "use_cpsat=false", "-q"]
    refusals = [
        ([str(video)], "MANIFEST " + str(video) + " holds video samples (first: 'v0') and no model is named"),
        ([str(video), "--model", "llama-3.1-8b"], "sample 'v0' (#0) is a video sample (1x9x16"),
        ([str(text), "--cost-model", "analytic-stdit3-xl-h200-sxm"], "sample 't0' (#0) is a text sample"),
        ([str(text), "--model", "llama-7b", "--cost-model", "analytic-llama-7b-h200-sxm"],
         "give one of --model, --model-config, --cost-model and --cost-model-file, not --model and --cost-model"),
    ]
    for args, message in refusals:
        code, output = _run("epoch", *args, *common)
        assert code == 2 and message in output, output
        assert not out.exists(), args
    code, output = _run("epoch", str(video), "--model", "wan2.1-1.3b", *common)
    assert code == 0 and "done, 2/2 steps" in output, output
    code, output = _run("epoch", str(text), "--model-config", str(LLAMA31), *common)
    assert code == 0 and "done, 2/2 steps" in output, output
    # A config named like a preset but of another shape is stored under its own id; a second run
    # of the same inputs finds that model and the stored job (the resume path).
    other = tmp_path / "llama-3.1-8b" / "config.json"
    other.parent.mkdir()
    other.write_text(json.dumps({**json.loads(LLAMA31.read_text()), "vocab_size": 32000}))
    for expected in ("done, 2/2 steps", "already stored"):
        code, output = _run("epoch", str(text), "--model-config", str(other), "--epoch-id", "other", *common)
        assert code == 0 and expected in output, output
    with sqlite3.connect(out) as conn:
        specs = {row[0]: json.loads(row[1]) for row in conn.execute("SELECT id, spec FROM epochs")}
        stored = [row[0] for row in conn.execute("SELECT id FROM cost_models")]
    assert specs["video-s0"]["model"] == {"name": "wan2.1-1.3b", "kind": "3d", "source": "model wan2.1-1.3b"}
    assert specs["text-s0"]["model"]["source"] == f"model_config {LLAMA31}"
    assert specs["text-s0"]["cost_model_id"] == "analytic-llama-3.1-8b-h200-sxm"  # the embedded preset's
    assert specs["other"]["cost_model_id"].startswith("analytic-llama-3.1-8b-h200-sxm-")
    assert stored == [specs["other"]["cost_model_id"]]


def test_epoch_text_manifest_defaults_to_the_text_model_and_says_so(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    text = _write(tmp_path / "text.jsonl", [{"id": f"t{i}", "tokens": 1024} for i in range(6)])
    out = tmp_path / "plans.sqlite"
    with caplog.at_level("INFO", logger="dcp_cli.epoch"):
        code, output = _run("epoch", str(text), "--out", str(out), "--samples-per-step", "6", "--workers", "1",
                            "--option", "use_cpsat=false")
    assert code == 0, output
    assert any("no model named: planning the text manifest" in r.getMessage() and "llama-7b" in r.getMessage()
               for r in caplog.records)
    with sqlite3.connect(out) as conn:
        spec = json.loads(conn.execute("SELECT spec FROM epochs").fetchone()[0])
    assert spec["cost_model_id"] == "analytic-llama-7b-h200-sxm" and spec["model"]["kind"] == "1d"


def test_profile_takes_a_model_config(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "p.jsonl"
    tiny = ["--hidden", "64", "--heads", "8", "--ffn", "128", "--vocab", "256", "--layers", "1", "--layer-counts",
            "1", "--num-sizes", "2", "--tokens-min", "64", "--tokens-max", "128", "--packings", "2", "--num-packed",
            "1", "--group-sizes", "1", "--head-sizes", "2", "--repeats", "1", "--warmup", "0", "-q"]
    code, output = _run("profile", "--out", str(out), "--model", "llama-7b", "--model-config", str(LLAMA31), *tiny)
    assert code == 2 and "not both" in output and not out.exists(), output
    code, output = _run("profile", "--out", str(out), "--model-config", str(LLAMA31), *tiny)
    assert code == 0, output
    header = json.loads(out.read_text().splitlines()[0])
    assert header["model"]["name"] == "llama-3.1-8b" and header["model"]["num_kv_heads"] == 8
    assert f"--model-config {LLAMA31}" in header["notes"]


def test_plan_matches_a_cost_model_file_to_a_config_by_shape_not_name(tmp_path: Path) -> None:
    """A config in a folder named after no preset plans under a file made for the same shape under
    another name; a config of another shape is refused naming the field that differs."""
    from costmodel.analytic import analytic_cost_model
    from costmodel.presets import load_hardware, load_model

    preset = load_model("llama-3.1-8b")
    path = tmp_path / "cm.json"
    analytic_cost_model(preset, load_hardware("h200-sxm")).save(path)
    data = {k: v for k, v in json.loads(LLAMA31.read_text()).items() if k != "_name_or_path"}
    mine = tmp_path / "my-finetune-run-7" / "config.json"
    mine.parent.mkdir()
    mine.write_text(json.dumps(data))
    args = ["-w", "text-longtail", "-c", "h200x64", "-k", "1", "-b", "64", "-q", "--cost-model", str(path)]
    code, output = _run("plan", "--model-config", str(mine), *args)
    assert code == 0, output
    wider = tmp_path / "wider" / "config.json"
    wider.parent.mkdir()
    wider.write_text(json.dumps({**data, "intermediate_size": data["intermediate_size"] * 2}))
    code, output = _run("plan", "--model-config", str(wider), *args)
    assert code == 2 and "another shape" in output and "ffn_hidden" in output, output
    # the workload's own model (llama-7b) is matched by shape too: a file of its shape under
    # another name plans it
    renamed = tmp_path / "renamed.json"
    llama7b = load_model("llama-7b").model_copy(update={"name": "my-llama-7b-copy"})
    analytic_cost_model(llama7b, load_hardware("h200-sxm")).save(renamed)
    code, output = _run("plan", *args[:-1], str(renamed))
    assert code == 0, output
