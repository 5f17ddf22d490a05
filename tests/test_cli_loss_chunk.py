"""``--loss-chunk-tokens`` of ``dcp plan``, ``dcp cost`` and ``dcp epoch``.

The target: a 1M-token-context Llama-3.1-8B workload (``text-millionctx``, documents up to
1,048,576 tokens) on 24 H200s plans with the chunked loss (the default), every micro-batch's
predicted peak per rank under the cap; with whole logits its longest documents fit nowhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app
from planner.workload import WorkloadSpec, sample_batch

ROOT = Path(__file__).resolve().parents[1]
LLAMA31 = str(ROOT / "examples/configs/llama-3.1-8b/config.json")
TARGET = ["plan", "--model-config", LLAMA31, "-w", "text-millionctx", "-c", "h200x24", "-k", "1", "-q"]


def test_llama31_8b_plans_a_million_token_context_on_24_h200s() -> None:
    longest = max(s.tokens for s in sample_batch(WorkloadSpec.preset("text-millionctx"), num_samples=256,
                                                  seed=0, step=0))
    assert longest > 800_000  # step 0 holds a document of 800k+ tokens
    result = CliRunner().invoke(app, [*TARGET, "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)["steps"][0]
    assert row["cost_model_id"] == "analytic-llama-3.1-8b-h200-sxm"
    assert 0 < row["peak_mem_bytes"] <= row["memory_cap_bytes"]


def test_whole_logits_refuse_the_longest_documents() -> None:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*TARGET, "--loss-chunk-tokens", "0"])
    assert result.exit_code == 2
    assert "fits nowhere" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--loss-chunk-tokens", "-8"], "--loss-chunk-tokens=-8 must be a positive number of tokens"),
    (["--loss-chunk-tokens", "2000000"], "--loss-chunk-tokens=2000000 is larger than the longest sample "
                                         "(1048576 tokens)"),
])
def test_plan_refuses_a_bad_chunk_naming_the_option(args: list[str], message: str) -> None:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*TARGET, *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


def test_cost_shows_the_chunk_and_refuses_a_bad_one() -> None:
    runner = CliRunner(env={"COLUMNS": "200"})
    base = ["cost", "131072", "--model-config", LLAMA31, "--cluster", "h200x24", "--json"]
    chunked = json.loads(runner.invoke(app, base).output)
    whole = json.loads(runner.invoke(app, [*base, "--loss-chunk-tokens", "0"]).output)
    assert chunked["loss_chunk_tokens"] == 4096 and whole["loss_chunk_tokens"] == 0
    assert chunked["loss_chunk_bytes"] == 4096 * 128256 * 6 and whole["loss_chunk_bytes"] == 0
    # per rank at d=16 with full checkpointing: 8,192 tokens x 12 B x 128,256 logits held whole,
    # one 4,096-token chunk (6 B a logit) chunked
    full = {r["group_size"]: r for r in chunked["rows"]}[16]["activation_bytes_full"]
    full_whole = {r["group_size"]: r for r in whole["rows"]}[16]["activation_bytes_full"]
    saved = (full_whole + whole["fixed_bytes"]) - (full + chunked["fixed_bytes"])
    assert saved == pytest.approx(8192 * (12 * 128256 - 4) - 4096 * 128256 * 6, rel=1e-12)
    bad = runner.invoke(app, ["cost", "1000", "--model-config", LLAMA31, "--loss-chunk-tokens", "1001"])
    assert bad.exit_code == 2 and "larger than the longest sample (1000 tokens)" in bad.output
    video = runner.invoke(app, ["cost", "2x4x4", "--model", "wan2.1-1.3b", "--loss-chunk-tokens", "8"])
    assert video.exit_code == 2 and "the LM loss chunk is for text models" in video.output


def test_epoch_refuses_a_chunk_longer_than_the_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "tokens": 100 * (i + 1)}) + "\n" for i in range(8)))
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
        "epoch", str(manifest), "--model", "llama-3.1-8b", "--samples-per-step", "4", "--out",
        str(tmp_path / "p.sqlite"), "--loss-chunk-tokens", "801", "-q"])
    assert result.exit_code == 2
    assert "--loss-chunk-tokens=801 is larger than the longest sample (800 tokens)" in result.output
    assert not (tmp_path / "p.sqlite").exists()
