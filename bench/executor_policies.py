"""Measured time and activation memory of the executor's reference models per checkpoint policy,
against the prediction of a cost model fitted on the same machine.

For each model kind (1D LLaMA-style, 2D STDiT-style):

1. profile the model's shape with the profiling stage (``costmodel.profiling.sweep.run_sweep``;
   on a machine without a hardware preset, also ``dcp profile-comm`` on 2 gloo ranks) and fit a
   cost model with ``costmodel.fit.fit_profiles`` -- the same public path as ``dcp profile`` /
   ``dcp fit``;
2. run the executor's own model (``executor.models``) on held-out micro-batches (shapes not in
   the sweep) under every policy ``k = 0..L`` (group of one rank): forward+backward time (fastest
   of the repeats, as the fit uses the fastest) and activation bytes
   (``executor.memory.ActivationMeter``: kept at the end of forward, and the peak over
   forward+backward; on a GPU also the allocator's peak);
3. compare with ``CostModel.microbatch_time_s`` and ``CostModel.activation_bytes``.

The meter's peak misses the one layer a checkpointed sample rematerialises in backward
(``torch.utils.checkpoint`` keeps it out of reach of saved-tensor hooks); ``kept_bytes`` (end of
forward) is exact. On a GPU the allocator's peak is recorded as well.

Prints a table and writes ``--out`` (default ``bench-out/executor_policies_<device>.json``).

Run (CPU; a few minutes on an idle 2-core machine)::

    .venv/bin/python bench/executor_policies.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.evaluate import CostModel, policy_name
from costmodel.fit import FitConfig, fit_profiles
from costmodel.presets import hardware_names, load_hardware
from costmodel.profiling.format import ComputeRecord, HeadRecord, Profile, read_profile
from costmodel.profiling.sweep import SweepConfig, make_header, run_sweep
from costmodel.specs import ClusterSpec, HardwareSpec, ModelSpec, Sample
from dcp_cli.net import free_port
from dcp_cli.progress import make_progress
from executor.context import SPContext
from executor.layout import PackedLayout, SampleShape
from executor.memory import ActivationMeter
from executor.models import Llama1D, ModelConfig, STDiT2D, init_weights

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _spec(kind: str, cfg: ModelConfig) -> ModelSpec:
    return ModelSpec(name=f"ref-{kind}-h{cfg.hidden}-l{cfg.num_layers}", kind=kind,  # type: ignore[arg-type]
                     num_layers=cfg.num_layers, hidden=cfg.hidden, num_heads=cfg.num_heads,
                     ffn_hidden=cfg.ffn_hidden, vocab=cfg.vocab if kind == "1d" else 0,
                     causal=kind == "1d", mlp="swiglu" if kind == "1d" else "gelu")


def _hardware(name: str) -> HardwareSpec:
    if name in hardware_names():
        return load_hardware(name)
    # Only the memory cap reads these numbers; predictions of time and bytes do not.
    return HardwareSpec(name=name, hbm_bytes=24 * 2**30, hbm_bandwidth_bytes_per_s=20e9,
                        bf16_dense_flops=1e11, nvlink_bytes_per_s_per_direction=5e9,
                        network_bytes_per_s_per_gpu=1e9)


def _comm_profile(hardware: str, tmp: Path) -> list[Profile]:
    """``dcp profile-comm`` on 2 gloo ranks when no hardware preset supplies the links."""
    if hardware in hardware_names():
        return []
    out = tmp / "comm.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(Path(sys.executable).with_name("dcp")), "profile-comm", "--out", str(out),
           "--hardware", hardware, "--backend", "gloo", "--num-sizes", "5", "--repeats", "5",
           "--gpus-per-node", "2"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return [read_profile(out)]


def fit_cost_model(kind: str, cfg: ModelConfig, *, hardware: str, device: torch.device, dtype: str,
                   sweep: SweepConfig, tmp: Path) -> tuple[Any, float]:
    """Profile the model's shape and fit a cost model; returns (fit result, seconds)."""
    start = time.perf_counter()
    spec = _spec(kind, cfg)
    records = run_sweep(spec, sweep, device=device, dtype=dtype)
    print(f"{kind}: profiled {len(records)} configurations in {time.perf_counter() - start:.0f} s",
          flush=True)
    header = make_header(model=spec, profiled=spec, hardware=hardware, device=device, dtype=dtype,
                         notes="bench/executor_policies.py")
    profile = Profile(header=header, compute=[r for r in records if isinstance(r, ComputeRecord)],
                      head=[r for r in records if isinstance(r, HeadRecord)])
    result = fit_profiles([profile, *_comm_profile(hardware, tmp)],
                          FitConfig(force=True, time_statistic="min"))
    return result, time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, kind: str, samples: list[Sample], k: int, *, device: torch.device,
            dtype: torch.dtype, cfg: ModelConfig, warmup: int, repeats: int) -> dict[str, float]:
    """Time and activation bytes of one micro-batch under policy ``k`` (group of one)."""
    layout = PackedLayout(samples=tuple(SampleShape(tokens=s.tokens, frames=s.num_frames) for s in samples),
                          group_size=1, index_in_group=0)
    ctx = SPContext(layout=layout, group=None)
    tokens = layout.total_tokens
    gen = torch.Generator().manual_seed(0)
    if kind == "1d":
        inputs = torch.randint(cfg.vocab, (tokens,), generator=gen).to(device)
        targets = torch.randint(cfg.vocab, (tokens,), generator=gen).to(device)
    else:
        inputs = torch.randn(tokens, cfg.in_channels, generator=gen).to(device=device, dtype=dtype)
        targets = torch.randn(tokens, cfg.in_channels, generator=gen).to(device=device, dtype=dtype)
    policies = [k] * len(samples)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(inputs, ctx, recompute_layers=policies)
        model.token_losses(out.float(), targets.float() if kind == "2d" else targets).sum().backward()  # type: ignore[operator]

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    with ActivationMeter().ignore_parameters(model) as meter:
        out = model(inputs, ctx, recompute_layers=policies)
        loss = model.token_losses(out.float(), targets.float() if kind == "2d" else targets).sum()  # type: ignore[operator]
        kept = meter.current_bytes
        del out
        loss.backward()
    result = {"time_s": statistics.median(times), "time_min_s": min(times),
              "kept_bytes": float(kept), "peak_bytes": float(meter.peak_bytes)}
    if device.type == "cuda":
        result["device_peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - base)
    return result


def held_out(kind: str, scale: float) -> list[list[Sample]]:
    """Micro-batches whose shapes are not on the sweep grid (``scale`` = tokens_max / 1024)."""
    if kind == "1d":
        sizes = [[750], [150, 350, 50], [450, 450], [125]]
        return [[Sample(id=f"h{i}-{j}", tokens=max(1, round(t * scale))) for j, t in enumerate(b)]
                for i, b in enumerate(sizes)]
    shapes = [[(3, 80)], [(6, 50), (1, 128)], [(12, 32)], [(5, 20), (2, 45), (3, 35)]]
    return [[Sample(id=f"h{i}-{j}", tokens=f * max(1, round(hw * scale)), frames=f,
                    height=max(1, round(hw * scale)), width=1)
             for j, (f, hw) in enumerate(b)] for i, b in enumerate(shapes)]


def run_kind(kind: str, cfg: ModelConfig, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Fit, measure and compare one model kind."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    sweep = SweepConfig(tokens_min=args.tokens_min, tokens_max=args.tokens_max, num_sizes=5,
                        packings=(2,), num_packed=3, frames=(1, 2, 4, 8, 16), layer_counts=(1, 2),
                        policies="all", num_head_sizes=5, warmup=1, repeats=args.repeats)
    fit, fit_s = fit_cost_model(kind, cfg, hardware=args.hardware, device=device, dtype=args.dtype,
                                sweep=sweep, tmp=tmp)
    cluster = ClusterSpec(name=f"{args.hardware}x1", hardware=_hardware(args.hardware), num_gpus=1,
                          gpus_per_node=1, state_sharding="replicated")
    cost = CostModel(file=fit.file, cluster=cluster)
    model = (Llama1D(cfg) if kind == "1d" else STDiT2D(cfg)).to(device=device, dtype=dtype)
    init_weights(model, seed=0)
    rows: list[dict[str, Any]] = []
    for batch in held_out(kind, args.tokens_max / 1024):
        for k in range(cfg.num_layers + 1):
            got = measure(model, kind, batch, k, device=device, dtype=dtype, cfg=cfg,
                          warmup=1, repeats=args.repeats)
            pred_time = cost.microbatch_time_s(batch, group_size=1, recompute_layers=[k] * len(batch))
            pred_bytes = float(cost.activation_bytes([s.tokens for s in batch], group_size=1,
                                                     recompute_layers=k).sum())
            # Kept at the end of forward: the same without the layer rematerialised in backward.
            act = cost.file.activation
            tokens = sum(s.tokens for s in batch)
            pred_kept = tokens * ((cfg.num_layers - k) * act.bytes_per_token_layer_none
                                  + k * act.bytes_per_token_layer_full + act.working_bytes_per_token)
            rows.append({
                "samples": [[s.num_frames, s.spatial_tokens] for s in batch],
                "tokens": sum(s.tokens for s in batch), "policy": policy_name(k, cfg.num_layers),
                "recompute_layers": k, **got, "pred_time_s": pred_time, "pred_activation_bytes": pred_bytes,
                "pred_kept_bytes": pred_kept, "time_err": got["time_min_s"] / pred_time - 1,
                "peak_bytes_err": got["peak_bytes"] / pred_bytes - 1,
                "kept_bytes_err": got["kept_bytes"] / pred_kept - 1,
            })
    by_policy: dict[str, dict[str, float]] = {}
    for k in range(cfg.num_layers + 1):
        name = policy_name(k, cfg.num_layers)
        sel = [r for r in rows if r["recompute_layers"] == k]
        by_policy[name] = {
            "time_mape": statistics.mean(abs(r["time_err"]) for r in sel),
            "peak_bytes_mape": statistics.mean(abs(r["peak_bytes_err"]) for r in sel),
            "kept_bytes_mape": statistics.mean(abs(r["kept_bytes_err"]) for r in sel),
            "mean_kept_bytes": statistics.mean(r["kept_bytes"] for r in sel),
            "mean_pred_kept_bytes": statistics.mean(r["pred_kept_bytes"] for r in sel),
            "mean_time_s": statistics.mean(r["time_min_s"] for r in sel),
            "mean_peak_bytes": statistics.mean(r["peak_bytes"] for r in sel),
        }
    return {"model": _spec(kind, cfg).model_dump(mode="json"), "cost_model_id": fit.file.id,
            "fit_quality": {name: t.mape for name, t in fit.terms.items()}, "fit_wall_s": fit_s,
            "rows": rows, "by_policy": by_policy}


def main() -> None:
    """Run the benchmark for both kinds and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="Default float32 on CPU, bfloat16 on GPU.")
    parser.add_argument("--hardware", default=None, help="Hardware name (default: cpu, or h200-sxm on CUDA).")
    parser.add_argument("--kinds", default="1d,2d")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=0, help="MLP inner size (default 4*hidden; 1D 8/3*hidden).")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--tokens-min", type=int, default=32)
    parser.add_argument("--tokens-max", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0 = torch default; 1 avoids OpenMP thrash on a busy CPU).")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quiet", "-q", action="store_true", help="No progress bar: the tables only.")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.hardware = args.hardware or ("cpu" if args.device == "cpu" else "h200-sxm")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or default_out(f"executor_policies_{args.device}")
    report: dict[str, Any] = {
        "benchmark": "executor_policies", "device": args.device, "dtype": args.dtype,
        "hardware": args.hardware, "threads": torch.get_num_threads(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "kinds": {}}
    kinds = args.kinds.split(",")
    bar = make_progress(quiet=args.quiet, transient=True)
    task = bar.add_task(f"profiling, fitting and running {len(kinds)} kind(s)", total=len(kinds))
    bar.start()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            ffn = args.ffn or (args.hidden * 8 // 3 // 16 * 16 if kind == "1d" else 4 * args.hidden)
            cfg = ModelConfig(num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                              ffn_hidden=ffn, vocab=args.vocab, in_channels=4)
            result = run_kind(kind, cfg, args, Path(tmp))
            bar.advance(task)
            report["kinds"][kind] = result
            print(f"\n{kind}: {result['model']['name']} on {args.device} ({args.dtype}); fitted "
                  f"{result['cost_model_id']} in {result['fit_wall_s']:.0f} s, held-out fit MAPE "
                  + ", ".join(f"{k} {v:.1%}" for k, v in result["fit_quality"].items() if v is not None))
            print(f"{'policy':<14}{'time ms':>10}{'pred ms':>10}{'t MAPE':>9}{'kept MB':>10}"
                  f"{'pred MB':>10}{'k MAPE':>9}{'peak MB':>10}{'pred MB':>10}{'p MAPE':>9}")
            for name, agg in result["by_policy"].items():
                sel = [r for r in result["rows"] if r["policy"] == name]
                pred_t = statistics.mean(r["pred_time_s"] for r in sel)
                pred_b = statistics.mean(r["pred_activation_bytes"] for r in sel)
                print(f"{name:<14}{1e3 * agg['mean_time_s']:>10.2f}{1e3 * pred_t:>10.2f}"
                      f"{agg['time_mape']:>9.1%}{agg['mean_kept_bytes'] / 2**20:>10.2f}"
                      f"{agg['mean_pred_kept_bytes'] / 2**20:>10.2f}{agg['kept_bytes_mape']:>9.1%}"
                      f"{agg['mean_peak_bytes'] / 2**20:>10.2f}"
                      f"{pred_b / 2**20:>10.2f}{agg['peak_bytes_mape']:>9.1%}")
    bar.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(), **report}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
