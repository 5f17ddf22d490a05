"""The one-device ring probe (``costmodel/profiling/ring_probe.py``): its ring steps are attention
on the joined blocks (fp64, against attention written out here), and ``dcp profile
--ring-degrees`` writes ring_attention records that the ring fit reads."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from costmodel.fit_terms import SplitConfig  # noqa: E402
from costmodel.profiling.format import read_profile  # noqa: E402
from costmodel.profiling.ring_probe import measure_ring_attention, measure_ring_steps_one_gpu, ring_steps  # noqa: E402
from costmodel.ring.fit import fit_ring_attention  # noqa: E402
from dcp_cli.main import app  # noqa: E402


def test_ring_steps_are_attention_on_the_joined_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    blocks = [(torch.randn(3, 4, 8, generator=gen, dtype=torch.float64),
               torch.randn(3, 4, 8, generator=gen, dtype=torch.float64)) for _ in range(3)]
    k = torch.cat([b[0] for b in blocks], dim=1)
    v = torch.cat([b[1] for b in blocks], dim=1)
    plain = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v
    assert torch.allclose(ring_steps(q, blocks), plain, rtol=1e-12, atol=1e-12)


def test_measured_records_and_their_fit() -> None:
    records = measure_ring_attention(tokens=[128, 256, 512, 100], ring_degrees=[2, 4], num_heads=4, head_dim=16,
                                     device=torch.device("cpu"), dtype=torch.float32, warmup=0, repeats=2)
    # 100 tokens do not split into 4 blocks... but do into 2; every other size into both
    assert sorted((r.tokens, r.ring_degree) for r in records) == [
        (100, 2), (100, 4), (128, 2), (128, 4), (256, 2), (256, 4), (512, 2), (512, 4)]
    assert all(r.num_heads == 4 and r.head_dim == 16 and r.ulysses_time_s > 0 for r in records)
    half, merge, result = fit_ring_attention(records, SplitConfig(holdout_fraction=0.25, seed=0,
                                                                  time_statistic="median"), hbm_bytes_per_s=1e11)
    assert half >= 0 and merge >= 0 and result.num_heldout == 2
    with pytest.raises(ValueError, match="splits evenly"):
        measure_ring_attention(tokens=[128], ring_degrees=[3], num_heads=4, head_dim=16, device=torch.device("cpu"),
                               dtype=torch.float32, warmup=0, repeats=1)
    with pytest.raises(ValueError, match="CUDA"):
        measure_ring_steps_one_gpu(block_bytes=[1024], compute_dims=[64], device=torch.device("cpu"), warmup=0,
                                   repeats=1)


def test_dcp_profile_writes_ring_attention_records(tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl"
    args = ["profile", "--model", "llama-7b", "--out", str(out), "--layers", "1", "--layer-counts", "1",
            "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "256", "--tokens-min", "64",
            "--tokens-max", "256", "--num-sizes", "3", "--packings", "2", "--num-packed", "1", "--group-sizes", "1",
            "--head-sizes", "2", "--warmup", "0", "--repeats", "2", "--ring-degrees", "2", "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    profile = read_profile(out)
    assert profile.header.format == "dcp-profile/4"
    assert sorted(r.tokens for r in profile.ring_attention) == [64, 128, 256]
    assert {r.ring_degree for r in profile.ring_attention} == {2} and profile.compute
    bad = CliRunner().invoke(app, [*args[:-3], "--ring-degrees", "3", "--quiet"])
    assert bad.exit_code == 2 and "ring_degrees=[3]" in bad.output
