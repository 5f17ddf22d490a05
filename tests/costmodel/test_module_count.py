"""Counting what a stack of modules keeps (costmodel.profiling.module_count) and profiling a
model's own class (``dcp profile --model-config``, with its look-alike fallback)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from costmodel.profiling.module_count import profile_module
from costmodel.profiling.real_classes import BlockInputs
from costmodel.profiling.real_layers import layer_factory
from costmodel.specs import ModelSpec
from dcp_cli.main import app

HIDDEN = 8


class SigmoidSquare(nn.Module):
    """``exp(sigmoid(x) * sigmoid(x))``: sigmoid saves its output, the product saves that same
    storage twice, exp saves its output: two storages of ``s x h`` a layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x)
        return torch.exp(a * a)


def _inputs(tokens: int, *, device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> BlockInputs:
    x = torch.randn((tokens, HIDDEN), generator=generator).to(device=device, dtype=dtype).requires_grad_(True)
    return BlockInputs(state=(x,), context=(), tokens=tokens)


def _call(block: nn.Module, state: tuple[torch.Tensor, ...], context: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    return (block(state[0]),)


def test_storages_count_once_and_a_checkpoint_keeps_its_input() -> None:
    rows = profile_module(lambda i: SigmoidSquare(), _inputs, _call, tokens=[5, 12], num_layers=2,
                          dtype=torch.float32, repeats=1, warmup=0)
    by = {(r.tokens, r.recompute_layers): r for r in rows}
    for s in (5, 12):
        value = s * HIDDEN * 4  # one fp32 storage of s x h
        # k plain layers keep 2 storages each (sigmoid's output counted once); a checkpointed one its input
        assert [by[(s, k)].saved_bytes for k in (0, 1, 2)] == [4 * value, value + 2 * value, 2 * value]
        for k in (0, 1, 2):
            r = by[(s, k)]
            assert r.peak_bytes >= r.forward_peak_bytes >= r.kept_bytes >= 0
            assert r.transient_bytes == r.peak_bytes - r.kept_bytes
            assert r.cuda_max_allocated_bytes is None and r.time_s > 0
        # live after forward: what is saved but the last exp's output, which is the stack's output
        assert by[(s, 0)].kept_bytes == by[(s, 0)].saved_bytes - value


def test_bad_policies_and_tokens_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"policies \[3\] are outside \[0, num_layers=2\]"):
        profile_module(lambda i: SigmoidSquare(), _inputs, _call, tokens=[4], policies=[3])
    with pytest.raises(ValueError, match="need token counts >= 1"):
        profile_module(lambda i: SigmoidSquare(), _inputs, _call, tokens=[0])


@pytest.mark.gpu
def test_cuda_allocator_peak_is_recorded() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = profile_module(lambda i: SigmoidSquare(), _inputs, _call, tokens=[4096], num_layers=2, device="cuda",
                          dtype=torch.float32, repeats=1, policies=[0])
    r = rows[0]
    assert r.cuda_max_allocated_bytes is not None and r.cuda_max_allocated_bytes >= r.saved_bytes
    assert r.saved_bytes == 4 * 4096 * HIDDEN * 4


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}


def test_a_config_without_its_library_falls_back_to_the_look_alike_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    spec = ModelSpec(name="t", kind="1d", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, ffn_hidden=128,
                     vocab=256, family="llama")
    factory, note = layer_factory(LLAMA, profiled=spec)
    assert factory is not None and "LlamaDecoderLayer" in note
    monkeypatch.setitem(sys.modules, "transformers", None)  # an environment without transformers
    factory, note = layer_factory(LLAMA, profiled=spec)
    assert factory is None and note.startswith("look-alike blocks") and "cannot import" in note


def _profile(tmp_path: Path, *extra: str) -> Any:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    out = tmp_path / "prof.jsonl"
    result = CliRunner().invoke(app, ["profile", "--model-config", str(config), "--out", str(out), "--layers", "2",
                                      "--tokens-min", "16", "--tokens-max", "32", "--num-sizes", "2", "--num-packed",
                                      "1", "--packings", "2", "--head-sizes", "2", "--repeats", "1", "--warmup", "0",
                                      "-q", *extra])
    return result, out


def test_dcp_profile_model_config_runs_the_models_own_class(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result, out = _profile(tmp_path)
    assert result.exit_code == 0, result.output
    assert "real layer class transformers.models.llama.modeling_llama.LlamaDecoderLayer" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert "LlamaDecoderLayer" in lines[0]["notes"] and lines[0]["model"]["family"] == "llama"
    compute = [r for r in lines if r["record"] == "compute"]
    assert compute and {r["group_size"] for r in compute} == {1}
    plain = {r["tokens_per_rank"]: r["activation_bytes"] for r in compute
             if r["num_layers"] == 1 and r["recompute_layers"] == 0 and len(r["samples"]) == 1}
    assert plain[32] > plain[16] > 0
    refused, _ = _profile(tmp_path, "--group-sizes", "1,2")
    assert refused.exit_code == 2 and "runs whole samples" in refused.output
