"""``dcp plan`` / ``dcp epoch`` on the mixture-of-experts and sliding-window configs in
``costmodel/presets/model_configs`` (gpt-oss-20b, Qwen3-30B-A3B, Gemma-3-27B on a B200 cluster), ``--expert-parallel``,
and bad configs refused naming the field with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app

pytestmark = pytest.mark.timeout(300)

CONFIGS = Path(__file__).resolve().parents[1] / "costmodel" / "presets" / "model_configs"
runner = CliRunner(env={"COLUMNS": "250"})


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def _plan(config: str, *extra: str) -> tuple[int, str]:
    return _run("plan", "--model-config", str(CONFIGS / f"{config}.json"), "-w", "text-longtail", "-c", "h200x64",
                "-k", "1", "-b", "64", "--json", "-q", *extra)


def test_gpt_oss_20b_plans_on_h200x64() -> None:
    code, output = _plan("gpt-oss-20b")
    assert code == 0, output
    steps = json.loads(output)["steps"]
    assert sum(steps[0]["group_sizes"]) == 64
    assert steps[0]["peak_mem_bytes"] <= steps[0]["memory_cap_bytes"]


def test_qwen3_moe_plans_with_its_experts_split() -> None:
    # Every expert on every rank: 30.5B bf16 parameters and gradients alone are 122 GB.
    code, output = _plan("qwen3-30b-a3b")
    assert code == 2 and "model states and working buffers need 124 GiB per rank" in output, output
    code, output = _plan("qwen3-30b-a3b", "--expert-parallel", "8")
    assert code == 0, output
    assert sum(json.loads(output)["steps"][0]["group_sizes"]) == 64
    code, output = _plan("qwen3-30b-a3b", "--expert-parallel", "3")
    assert code == 2 and "expert_parallel_size=3 does not divide num_gpus=64" in output, output


def test_gemma3_27b_plans_on_b200_not_on_h200() -> None:
    # 27.0B parameters: 108 GB of bf16 parameters and gradients before any activation; the
    # executor's state shardings (replicated, ZeRO-1, FSDP2 as it runs it) all keep them whole.
    code, output = _plan("gemma-3-27b")
    assert code == 2 and "over the memory cap 105 GiB" in output, output
    code, output = _run("plan", "--model-config", str(CONFIGS / "gemma-3-27b.json"), "-w", "text-longtail",
                        "-c", "b200x64", "-k", "1", "-b", "64", "--json", "-q")
    assert code == 0, output
    step = json.loads(output)["steps"][0]
    assert sum(step["group_sizes"]) == 64 and step["peak_mem_bytes"] <= step["memory_cap_bytes"]


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["full_attention"] * 23}, "field 'layer_types' has 23 entries but num_hidden_layers=24"),
    ({"sliding_window": -128}, "field 'sliding_window' must be a positive integer, got -128"),
    ({"num_experts_per_tok": 64}, "field 'num_experts_per_tok'=64 is above num_local_experts=32"),
])
def test_bad_configs_are_refused_with_nothing_written(tmp_path: Path, change: dict[str, object],
                                                       message: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads((CONFIGS / "gpt-oss-20b.json").read_text()), **change}))
    manifest = tmp_path / "text.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"t{i}", "tokens": 512}) + "\n" for i in range(4)))
    out = tmp_path / "plans.sqlite"
    code, output = _run("epoch", str(manifest), "--model-config", str(config), "--out", str(out),
                        "--samples-per-step", "4", "--workers", "1", "-q")
    assert code == 2 and f"{config}: {message}" in output, output
    assert not out.exists()
    code, output = _run("plan", "--model-config", str(config), "-w", "text-longtail", "-c", "h200x64", "-q")
    assert code == 2 and message in output, output


def test_profiling_refuses_experts_and_windows(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    code, output = _run("profile", "--model-config", str(CONFIGS / "gpt-oss-20b.json"), "--out",
                        str(tmp_path / "p.jsonl"), "--layers", "1", "-q")
    assert code == 2 and "has experts or sliding-window layers" in output, output
    assert not (tmp_path / "p.jsonl").exists()
