"""The ring's coefficients fitted to ring records (``costmodel.ring.fit``): recovered exactly from
records made with known values, checked on held-out records, carried by ``dcp fit`` into the file
and used by the cost model; ``dcp profile-comm --ops ring_step`` on two gloo ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from costmodel.evaluate import CostModel
from costmodel.fit import fit_profiles
from costmodel.fit_terms import SplitConfig
from costmodel.presets import load_hardware, load_model
from costmodel.profiling.format import CommRecord, RingAttentionRecord, read_profile
from costmodel.ring.fit import fit_ring, fit_ring_attention, fit_ring_steps
from costmodel.schema import CostModelFile, RingCoefficients
from tests.costmodel.test_fit_synthetic import synthetic_profile
from tests.planner.tiny import tiny_cluster

SPLIT = SplitConfig(holdout_fraction=0.25, seed=0, time_statistic="median")
PHI, OVERHEAD_S = 0.3, 15e-6
BLOCK_HALF, MERGE_B = 200.0, 16.0
HBM = load_hardware("h200-sxm").hbm_bandwidth_bytes_per_s


def _timed(t: float) -> dict[str, float | int]:
    return {"time_s": t, "time_s_min": t, "time_s_max": t, "num_repeats": 5}


def _steps(noise: float = 0.0, seed: int = 0) -> list[CommRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for nbytes in (1e5, 1e6, 4e6):
        for c in (2e-4, 1e-3, 5e-3):
            h = 2e-5 + nbytes / 2e9
            t = (max(c, h) + PHI * min(c, h) + OVERHEAD_S) * (1 + noise * rng.standard_normal())
            out.append(CommRecord(op="ring_step", group_size=2, num_nodes=1, bytes_per_rank=nbytes,
                                  compute_s=c, hop_s=h, **_timed(t)))
    return out


def _attention(noise: float = 0.0, seed: int = 0) -> list[RingAttentionRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for s in (1024, 4096, 16384):
        for r in (2, 4, 8):
            heads, dim = 8, 64
            ulysses = 1e-12 * s * s * heads * dim / r
            t = (ulysses * (1 + BLOCK_HALF * r / s) + MERGE_B * (r - 1) * s / r * heads * dim / HBM) * (
                1 + noise * rng.standard_normal())
            out.append(RingAttentionRecord(tokens=s, ring_degree=r, num_heads=heads, head_dim=dim,
                                           ulysses_time_s=ulysses, **_timed(t)))
    return out


def test_the_step_and_block_terms_are_recovered_from_records_made_with_them() -> None:
    phi, overhead, result = fit_ring_steps(_steps(), SPLIT)
    assert (phi, overhead) == pytest.approx((PHI, OVERHEAD_S), rel=1e-6)
    assert result.mape < 1e-9 and result.num_heldout == 2
    half, merge, result = fit_ring_attention(_attention(), SPLIT, hbm_bytes_per_s=HBM)
    assert (half, merge) == pytest.approx((BLOCK_HALF, MERGE_B), rel=1e-6)
    assert result.mape < 1e-9
    # noisy records: close, and the held-out error says how close
    phi, overhead, result = fit_ring_steps(_steps(noise=0.02, seed=3), SPLIT)
    assert phi == pytest.approx(PHI, abs=0.1) and 0 < result.mape < 0.05
    with pytest.raises(ValueError, match="too few points for ring_step"):
        fit_ring_steps(_steps()[:2], SPLIT)


def test_dcp_fit_carries_the_ring_into_the_file_and_the_cost_model_uses_it(tmp_path: Path) -> None:
    model = load_model("llama-7b")
    base = synthetic_profile(model, noise=0.0)
    plain = fit_profiles([base]).file
    assert plain.comm.ring is None  # no ring records: the published defaults at evaluation
    profile = base.model_copy(update={"comm": [*base.comm, *_steps()], "ring_attention": _attention()})
    result = fit_profiles([profile])
    ring = result.file.comm.ring
    assert ring is not None
    assert (ring.exposed_fraction, ring.step_overhead_s) == pytest.approx((PHI, OVERHEAD_S), rel=1e-6)
    assert (ring.block_half_tokens, ring.merge_bytes_per_channel) == pytest.approx((BLOCK_HALF, MERGE_B), rel=1e-6)
    assert {"ring_step", "ring_attention"} <= set(result.file.fit_quality)
    assert "ring: exposed fraction 0.3" in result.file.notes
    result.file.save(tmp_path / "cm.json")
    assert CostModelFile.load(tmp_path / "cm.json") == result.file
    cluster = tiny_cluster(num_gpus=8, gpus_per_node=4, hbm_bytes=1e12).model_copy(
        update={"hardware": load_hardware(result.file.hardware)})
    fitted, default = (CostModel(file=f, cluster=cluster) for f in (result.file, plain))
    assert fitted.ring_coefficients == ring and default.ring_coefficients == RingCoefficients()
    layout = fitted.place(first_rank=0, group_size=4, ring_degree=4)
    assert fitted.ring_exposed_s([8192], [0], layout=layout) != default.ring_exposed_s([8192], [0], layout=layout)
    # only one kind of records: the other terms keep their defaults, and the source says so
    steps_only = fit_ring(_steps(), [], SPLIT, hbm_bytes_per_s=HBM)
    assert steps_only is not None
    assert steps_only.coefficients.block_half_tokens == RingCoefficients().block_half_tokens
    assert "no ring_attention records" in steps_only.coefficients.source
    assert fit_ring([], [], SPLIT, hbm_bytes_per_s=HBM) is None


@pytest.mark.timeout(200)
def test_profile_comm_measures_ring_steps_on_two_gloo_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "ring.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "dcp_cli.main", "profile-comm", "--out", str(out), "--bytes-min", "65536", "--bytes-max", "1048576",
           "--num-sizes", "2", "--repeats", "3", "--warmup", "1", "--ops", "p2p,ring_step", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = read_profile(out)
    steps = [r for r in profile.comm if r.op == "ring_step"]
    assert len(steps) == 2 * 3  # 2 message sizes x the 3 default product sizes
    assert {r.bytes_per_rank for r in steps} == {65536.0, 1048576.0}
    assert all(r.compute_s and r.hop_s and r.time_s > 0 for r in steps)
    assert "ring step: exposed fraction" in proc.stdout
