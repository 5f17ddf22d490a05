"""The ring's cost coefficients (``costmodel.schema.RingCoefficients``) measured on one device and
fitted: block efficiency by size, merges, exposed fraction of a hop, fixed cost per step.

* Block efficiency: for each sample size ``s`` and ring degree ``r``, one rank's ``r`` ring steps
  (attention of ``s/r`` queries on an ``s/r``-token block, forward+backward, for ``H`` heads) and
  their ``r - 1`` log-sum-exp merges, beside the same pairs as one kernel over the whole sample
  (``H/r`` heads): ``ring_attention`` records. On CUDA the attention is PyTorch's
  ``scaled_dot_product_attention`` (flash attention where it applies) and a merge is timed on its
  own (the fp32 output and log-sum-exp update of ``costmodel.profiling.ring_probe.ring_steps``);
  on CPU the written-out attention of ``ring_probe`` (a smoke test of the pipeline only).
* Overlap: on CUDA, a hop emulated by a device-to-device copy on a second stream beside a matrix
  product (``ring_probe.measure_ring_steps_one_gpu``): ``ring_step`` records. A copy engine's
  overlap bounds the exposed fraction from below; ``dcp profile-comm --ops ring_step`` under
  torchrun measures NCCL's real hop (``bench/gpu_ring.sh`` runs it with 2 GPUs or more).
* The fit: ``costmodel.ring.fit.fit_ring`` (held-out error per term); the measured efficiency of
  each block size as a share of peak beside the published curve the analytic default uses
  (``costmodel/presets/kernel_efficiency.json``).

Prints a table and the fitted values, writes JSON.

    .venv/bin/python bench/ring_coefficients.py --device cuda --hardware h100-sxm \\
        --out bench/results/ring_coefficients_cuda.json
    .venv/bin/python bench/ring_coefficients.py --device cpu --tokens 256 512 --degrees 2 4 \\
        --heads 4 --head-dim 32 --out /tmp/ring_coefficients_smoke.json          # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from costmodel.fit_terms import SplitConfig
from costmodel.kernel_efficiency import kernel_efficiency
from costmodel.presets import load_hardware
from costmodel.profiling.format import CommRecord, RingAttentionRecord
from costmodel.profiling.measure import time_interleaved
from costmodel.profiling.ring_probe import measure_ring_attention, measure_ring_steps_one_gpu
from costmodel.ring.fit import fit_ring

logger = logging.getLogger(__name__)
SPLIT = SplitConfig(holdout_fraction=0.25, seed=0, time_statistic="median")
FWD_BWD_FLOPS_PER_PAIR_CHANNEL = 4.0 * 3.5
"""Attention FLOPs per (query, key) pair and channel, forward (4) plus backward (2.5 x 4)."""


def sdpa_ring_records(*, tokens: list[int], degrees: list[int], heads: int, head_dim: int, device: torch.device,
                      dtype: torch.dtype, warmup: int, repeats: int) -> list[RingAttentionRecord]:
    """``ring_attention`` records with the device's fused attention: ``r`` block kernels plus
    ``r - 1`` merges (timed apart: SDPA returns no log-sum-exp) against one kernel on ``H/r`` heads."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    cases = [(s, r) for s in tokens for r in degrees if s % r == 0 and heads % r == 0]
    steps: list[Callable[[], None]] = []
    for s, r in cases:
        qb, kb, vb = (t(1, heads, s // r, head_dim) for _ in range(3))
        qu, ku, vu = (t(1, heads // r, s, head_dim) for _ in range(3))
        out = torch.randn(1, heads, s // r, head_dim, device=device, dtype=torch.float32)
        part = torch.randn(1, heads, s // r, head_dim, device=device, dtype=dtype)
        lse, part_lse = (torch.randn(1, heads, s // r, device=device, dtype=torch.float32) for _ in range(2))

        def block(q=qb, k=kb, v=vb) -> None:  # type: ignore[no-untyped-def]
            sdpa(q, k, v).float().sum().backward()

        def one(q=qu, k=ku, v=vu) -> None:  # type: ignore[no-untyped-def]
            sdpa(q, k, v).float().sum().backward()

        def merge(out=out, part=part, lse=lse, part_lse=part_lse) -> None:  # type: ignore[no-untyped-def]
            new = torch.logaddexp(lse, part_lse)
            _ = out * torch.exp(lse - new)[..., None] + part.float() * torch.exp(part_lse - new)[..., None]

        steps += [block, one, merge]
    timings = time_interleaved(steps, device=device, warmup=warmup, repeats=repeats)
    records = []
    for i, (s, r) in enumerate(cases):
        block_t, one_t, merge_t = timings[3 * i: 3 * i + 3]
        ring = r * block_t.time_s + (r - 1) * merge_t.time_s
        records.append(RingAttentionRecord(
            tokens=s, ring_degree=r, num_heads=heads, head_dim=head_dim, causal=False, time_s=ring,
            time_s_min=min(ring, r * block_t.time_s_min + (r - 1) * merge_t.time_s_min),
            time_s_max=max(ring, r * block_t.time_s_max + (r - 1) * merge_t.time_s_max),
            num_repeats=block_t.num_repeats, ulysses_time_s=one_t.time_s))
    return records


def fit_report(attention: list[RingAttentionRecord], steps: list[CommRecord], *, hardware: str
               ) -> dict[str, Any]:
    """The fitted coefficients, their held-out errors and each block size's measured efficiency
    beside the published curve (the part that needs no device: tested on CPU)."""
    hw = load_hardware(hardware)
    fit = fit_ring(steps, attention, SPLIT, hbm_bytes_per_s=hw.hbm_bandwidth_bytes_per_s)
    rows = []
    for rec in attention:
        block = rec.tokens // rec.ring_degree
        pairs_channels = rec.ring_degree * block * block * rec.num_heads * rec.head_dim
        one = pairs_channels * FWD_BWD_FLOPS_PER_PAIR_CHANNEL / (rec.ulysses_time_s * hw.bf16_dense_flops)
        ring = pairs_channels * FWD_BWD_FLOPS_PER_PAIR_CHANNEL / (rec.time_s * hw.bf16_dense_flops)
        curves = kernel_efficiency(hardware, head_dim=rec.head_dim, causal=False)
        published = None if curves is None else {
            "forward": float(curves.attention.forward.at(block)),
            "backward": float(curves.attention.backward.at(block)),
            "forward_whole": float(curves.attention.forward.at(rec.tokens))}
        rows.append({"tokens": rec.tokens, "ring_degree": rec.ring_degree, "block_tokens": block,
                     "ring_s": rec.time_s, "one_kernel_s": rec.ulysses_time_s,
                     "ring_over_one": rec.time_s / rec.ulysses_time_s,
                     "efficiency_ring": ring, "efficiency_one_kernel": one, "published_efficiency": published})
    coefficients = None if fit is None else fit.coefficients.model_dump(mode="json")
    errors = {} if fit is None else {name: {"mape": t.mape, "num_points": t.num_points, "num_heldout": t.num_heldout}
                                     for name, t in fit.terms.items()}
    return {"hardware": hardware, "coefficients": coefficients, "held_out": errors, "blocks": rows,
            "ring_steps": [r.model_dump(mode="json") for r in steps]}


def print_report(report: dict[str, Any]) -> None:
    print(f"{'tokens':>8} {'r':>3} {'block':>7} {'ring ms':>9} {'1 kernel ms':>12} {'ratio':>6} "
          f"{'eff ring':>9} {'eff 1k':>7} {'published fwd/bwd at block':>27}")
    for row in report["blocks"]:
        pub = row["published_efficiency"]
        pub_text = "-" if pub is None else f"{pub['forward']:.3f}/{pub['backward']:.3f}"
        print(f"{row['tokens']:>8} {row['ring_degree']:>3} {row['block_tokens']:>7} {row['ring_s'] * 1e3:>9.3f} "
              f"{row['one_kernel_s'] * 1e3:>12.3f} {row['ring_over_one']:>6.3f} {row['efficiency_ring']:>9.3f} "
              f"{row['efficiency_one_kernel']:>7.3f} {pub_text:>27}")
    c = report["coefficients"]
    if c is None:
        print("no ring records: nothing fitted")
        return
    print(f"fitted: exposed_fraction {c['exposed_fraction']:.3f}, step_overhead_s {c['step_overhead_s'] * 1e6:.1f} us, "
          f"block_half_tokens {c['block_half_tokens']:.1f}, merge_bytes_per_channel {c['merge_bytes_per_channel']:.2f}")
    print(f"  ({c['source']})")
    for name, e in report["held_out"].items():
        print(f"  {name}: held-out MAPE {e['mape']:.1%} on {e['num_heldout']} of {e['num_points'] + e['num_heldout']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--hardware", default="h100-sxm", help="Hardware preset (peak, HBM, published curve).")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="", help="bfloat16 on CUDA, float32 on CPU by default.")
    parser.add_argument("--block-bytes", type=int, nargs="+", default=[1 << 20, 1 << 23, 1 << 26])
    parser.add_argument("--compute-dims", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("ring_coefficients.py: no CUDA device (--device cpu for the smoke test)", file=sys.stderr)
        return 2
    dtype = {"": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    if device.type == "cuda":
        attention = sdpa_ring_records(tokens=args.tokens, degrees=args.degrees, heads=args.heads,
                                      head_dim=args.head_dim, device=device, dtype=dtype, warmup=args.warmup,
                                      repeats=args.repeats)
        steps = measure_ring_steps_one_gpu(block_bytes=args.block_bytes, compute_dims=args.compute_dims,
                                           device=device, warmup=args.warmup, repeats=args.repeats)
    else:
        attention = measure_ring_attention(tokens=args.tokens, ring_degrees=args.degrees, num_heads=args.heads,
                                           head_dim=args.head_dim, device=device, dtype=dtype, warmup=args.warmup,
                                           repeats=args.repeats)
        steps = []
        print("CPU: no second stream, the hop's overlap needs CUDA (or dcp profile-comm --ops ring_step)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance

    report = {**provenance(), **fit_report(attention, steps, hardware=args.hardware)}
    report |= {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
               "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
               "load_average": os.getloadavg(), "heads": args.heads, "head_dim": args.head_dim}
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
