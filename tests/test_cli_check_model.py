"""``dcp check-model`` end to end on 2 gloo ranks: profile the executor's layers, fit, plan, run,
compare (a small configuration; the accuracy targets are measured by bench/model_vs_executor.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from costmodel.analytic import alltoall_bytes_per_token_layer
from dcp_cli.check_comm import in_layer_shapes, profile_alltoall_in_layer
from dcp_cli.model_check import CheckConfig, ReferenceLayer, build_reference_model, reference_spec


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "mode"), [("1d", "--concurrent"), ("3d", "--no-concurrent")])
def test_check_model_runs_plans_and_predicts_peak_memory(tmp_path: Path, kind: str, mode: str) -> None:
    """Both ways of sharing the machine: ranks at once, or one-rank groups in turns (each
    rank's rounds while the others wait at a barrier); both kinds, the text decoder and the
    full-3D-attention DiT (two runs, not every pair: each is a spawned world of ~15 s)."""
    out = tmp_path / "report.json"
    dcp = Path(sys.executable).with_name("dcp")
    done = subprocess.run(
        [str(dcp), "check-model", "--kind", kind, "--world", "2", "--layers", "3", "--steps", "1",
         "--samples", "5", "--tokens-min", "64", "--tokens-max", "400", "--memory-tokens", "200",
         "--repeats", "2", "--sweep-sizes", "3", "--out", str(out), "--quiet", mode],
        capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "time MAPE" in done.stdout
    report = json.loads(out.read_text())
    rows = report["micro_batches"]
    assert rows and report["summary"]["micro_batches"] == len(rows)
    assert sum(r["num_samples"] for r in rows) == 5  # every sample ran exactly once
    for r in rows:
        assert r["time_s"] > 0 and math.isfinite(r["predicted_time_s"]) and r["predicted_time_s"] > 0
        assert r["peak_bytes"] > 0
        if r["group_size"] > 1:  # its twin on the emulated group ran too
            assert r["emulated_time_s"] > 0
    # Bytes do not depend on the machine's load: the fitted memory model must hold here (on
    # one-rank groups; across gloo ranks tiny shards carry buffers the emulated profile does not
    # see, measured in bench/model_vs_executor.py).
    single = [r for r in rows if r["group_size"] == 1]
    assert single
    for r in single:
        assert abs(r["predicted_peak_bytes"] / r["peak_bytes"] - 1) < 0.10, r
    # Samples longer than the memory allows ran checkpointed or split over both ranks.
    assert any(max(r["policies"]) > 0 or r["group_size"] == 2 for r in rows)
    assert report["cost_model"]["id"].startswith(f"fitted-ref-{kind}")


def test_emulated_group_runs_one_ranks_share() -> None:
    torch.set_num_threads(1)
    config = CheckConfig(kind="2d", num_layers=1, hidden=16, num_heads=4, ffn_hidden=32)
    layer = ReferenceLayer(build_reference_model(config).layers[0])  # type: ignore[index]
    samples = [(2, 6), (1, 4)]  # 16 tokens; a rank of 2 holds 8, of 4 holds 4
    for d in (1, 2, 4):
        x = torch.randn(16 // d, 16, requires_grad=True)
        y = layer(x, samples, d)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_in_layer_alltoall_profile_measures_the_executors_calls(kind: str) -> None:
    """Real gloo group vs local copy: every record is one shape of the sweep, at group size 2,
    with the mean bytes of the executor's calls (the cost model's per-token figure times the
    rank's tokens), and the fit prefers these records."""
    config = CheckConfig(kind=kind, num_layers=2, hidden=32, num_heads=4, ffn_hidden=64, tokens_min=32,
                         tokens_max=128, sweep_repeats=2)
    profile = profile_alltoall_in_layer(config)
    assert profile.comm, "no shape gave a positive in-layer all-to-all time"
    shapes = in_layer_shapes(config, 2)
    assert len(profile.comm) <= len(shapes)
    per_token, ops = alltoall_bytes_per_token_layer(reference_spec(config), dtype_bytes=4)
    expected = {per_token / ops * sum(f * hw for f, hw in shape) / 2 for shape in shapes}
    for rec in profile.comm:
        assert (rec.op, rec.group_size, rec.num_nodes, rec.context) == ("alltoall", 2, 1, "in_layer")
        assert rec.time_s > 0 and rec.num_repeats == 6
        assert any(rec.bytes_per_rank == pytest.approx(b, rel=0.02) for b in expected), rec.bytes_per_rank


def test_a_sweep_of_fewer_than_two_sizes_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="sweep_sizes must be >= 2, got 1"):
        CheckConfig(sweep_sizes=1)
    assert CheckConfig(sweep_sizes=2).sweep_sizes == 2
