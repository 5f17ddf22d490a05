"""``dcp profile-comm`` under torchrun with 2 and 4 gloo processes, then fitted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from costmodel.fit import FitConfig, fit_comm, fit_profiles
from costmodel.presets import load_model
from costmodel.profiling.format import (
    ComputeRecord,
    Profile,
    ProfileHeader,
    narrowed,
    read_profile,
)

TORCHRUN_TIMEOUT_S = 150


def _torchrun(num_procs: int, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={num_procs}", "-m", "dcp_cli.main", "profile-comm", "--out", str(out),
           "--bytes-min", "4096", "--bytes-max", "262144", "--num-sizes", "4", "--repeats", "3",
           "--warmup", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)


@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 20)
def test_comm_profile_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "comm2.jsonl"
    proc = _torchrun(2, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = read_profile(out)
    assert profile.header.world_size == 2 and profile.header.model is None
    assert {(r.op, r.group_size, r.placement) for r in profile.comm} == {
        ("alltoall", 2, "intra"), ("allreduce", 2, "intra")}
    assert len(profile.comm) == 2 * 4
    assert all(r.backend == "gloo" and r.time_s > 0 for r in profile.comm)
    fits, results = fit_comm(profile.comm, FitConfig(time_statistic="min"))
    assert [(f.placement, f.group_size) for f in fits["alltoall"]] == [("intra", 2)]
    assert fits["alltoall"][0].bytes_per_s > 0
    assert set(results) == {"alltoall", "allreduce"}


@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 20)
def test_comm_profile_four_ranks_on_two_emulated_nodes(tmp_path: Path) -> None:
    out = tmp_path / "comm4.jsonl"
    proc = _torchrun(4, out, "--gpus-per-node", "2", "--hardware", "cpu-loopback")
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = read_profile(out)
    assert profile.header.hardware == "cpu-loopback"
    keys = {(r.op, r.group_size, r.num_nodes) for r in profile.comm}
    for op in ("alltoall", "allreduce"):
        # size 2: groups [0,1] and [2,3] inside a node; 3 and 4 span both nodes
        assert {(d, n) for o, d, n in keys if o == op} == {(2, 1), (3, 2), (4, 2)}
    assert sum(1 for r in profile.comm if r.op == "alltoall" and r.group_size == 2) == 2 * 4
    # Fitted together with a compute profile: every placement is measured, nothing filled in.
    model = load_model("llama-7b")
    compute = Profile(
        header=ProfileHeader(hardware="cpu-loopback", device="cpu", dtype="float32", model=model,
                             profiled=narrowed(model, num_layers=2)),
        compute=[ComputeRecord(num_layers=n, recompute_layers=k, samples=[(1, s), (1, 2 * s)][:m],
                               group_size=1, tokens_per_rank=[s, 3 * s][m - 1],
                               time_s=t, time_s_min=t, time_s_max=t, num_repeats=1,
                               activation_bytes=3 * s * m * ((n - k) * 100 + k * 10))
                 for i, s in enumerate((128, 256, 512, 1024, 2048, 4096)) for m in (1, 2)
                 for n in (1, 2) for k in range(n + 1)
                 for t in [1e-3 + (n + k) * 1e-6 * s * m + n * 1e-9 * s * s * m + i * 1e-6]],
    )
    file = fit_profiles([compute, profile], FitConfig(force=True, time_statistic="min",
                                                      attention_half_tokens=0.0)).file
    for fits in (file.comm.alltoall, file.comm.allreduce):
        assert {(f.placement, f.group_size, f.num_nodes) for f in fits} == {
            ("intra", 2, 1), ("inter", 3, 2), ("inter", 4, 2)}
        assert all(f.bytes_per_s > 0 and f.alpha_s >= 0 for f in fits)
    assert "not measured" not in file.notes
    assert file.comm.alltoall_bytes_per_token_layer == pytest.approx(2 * 2 * (2 * 4096 + 2 * 4096))


@pytest.mark.timeout(60)
def test_comm_sweep_refuses_a_single_rank_and_bad_config(tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist

    from costmodel.profiling.comm import CommSweepConfig, run_comm_sweep

    with pytest.raises(ValueError, match="bytes_min"):
        CommSweepConfig(bytes_min=10, bytes_max=5)
    with pytest.raises(ValueError, match="ops"):
        CommSweepConfig(ops=("broadcast",))
    with pytest.raises(ValueError, match="group sizes"):
        CommSweepConfig(group_sizes=(1,))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            run_comm_sweep(CommSweepConfig(), device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()
