"""Ring attention's backward with its hops overlapped vs synchronous: wall time per rank set.

One causal sample of T tokens on a ring of ``--world`` ranks (``u = 1``, zig-zag chunks,
``executor/ring.py``); every repeat runs the forward and the backward under both backward
schedules (``overlap_backward=True``: each hop posted before the compute it hides and waited for
after; ``False``: each waited for right after posting, synchronous as the backward before
37a46d6 was, though that one sent its gradients round the reverse ring), alternating which goes
first. A phase's time is the slowest rank's (all ranks start it at a barrier); medians over
the repeats. ``hop`` is one backward step's transfer alone (the key/value block and its gradient
sum, ``batch_isend_irecv`` both ways) on the same ranks: an upper bound on what overlap can save
per step. ``--check`` first compares the ring (fp64, packed samples, both schedules) with plain
per-sample softmax attention written here, not the ring's code. Prints a table and writes JSON.
``--world 1`` (one GPU) times the ring's loop alone: no hops, both schedules the same.

    .venv/bin/python bench/ring_overlap.py                                   # 4 gloo ranks, CPU
    .venv/bin/python bench/ring_overlap.py --backend nccl --device cuda --world 8 \\
        --tokens 32768 131072 --heads 8 --head-dim 128 --dtype bfloat16 --out bench/results/ring_overlap_cuda.json

On CPU each rank runs one thread (``torch.set_num_threads(1)``); gloo's sends progress on its
own threads, so whether they run beside the compute depends on free cores: the JSON records the
load average and the core count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from executor.layout import SampleShape  # noqa: E402
from executor.ring import ring_attention  # noqa: E402
from executor.ring_layout import RingLayout  # noqa: E402

CHECK_SAMPLES = (41, 23, 17)
"""Tokens of the packed samples of ``--check`` (each at least 2 x 8 for rings up to 8)."""


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: tuple[int, ...]) -> torch.Tensor:
    """Causal softmax attention inside each sample of a packed ``(T, H, Dh)`` sequence."""
    outs, start = [], 0
    for t in tokens:
        end = start + t
        scores = torch.einsum("thd,uhd->htu", q[start:end], k[start:end]) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        outs.append(torch.einsum("htu,uhd->thd", torch.softmax(scores.masked_fill(causal, float("-inf")), -1),
                                 v[start:end]))
        start = end
    return torch.cat(outs)


def _check(rank: int, world: int, device: torch.device) -> float:
    """Largest relative difference of output and q/k/v gradients, ring vs plain, over both schedules."""
    samples = tuple(SampleShape(tokens=t) for t in CHECK_SAMPLES)
    layout = RingLayout(samples=samples, ulysses_degree=1, ring_degree=world, index_in_group=rank)
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(sum(CHECK_SAMPLES), 4, 8, generator=gen, dtype=torch.float64).to(device) for _ in range(4)]
    q0, k0, v0 = (t.clone().requires_grad_(True) for t in full[:3])
    want_out = _plain_attention(q0, k0, v0, CHECK_SAMPLES)
    (want_out * full[3]).sum().backward()
    want = [want_out.detach(), q0.grad, k0.grad, v0.grad]
    offsets = layout.sample_offsets()

    def local(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layout.shard(x[offsets[s]:offsets[s + 1]], s) for s in range(len(samples))])

    worst = 0.0
    for overlap in (True, False):
        q, k, v = (local(t).clone().requires_grad_(True) for t in full[:3])
        out = ring_attention(q, k, v, layout=layout, group=dist.group.WORLD, causal=True, overlap_backward=overlap)
        (out * local(full[3])).sum().backward()
        for got, w in zip((out.detach(), q.grad, k.grad, v.grad), want, strict=True):
            assert got is not None and w is not None
            worst = max(worst, float((got - local(w)).abs().max()) / float(w.abs().max()))
    return worst


def _slowest(*times_s: float, device: torch.device) -> list[float]:
    t = torch.tensor(times_s, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.cpu()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hop_s(rows: int, shape: tuple[int, ...], *, rank: int, world: int, dtype: torch.dtype,
           device: torch.device) -> float:
    """One backward step's transfer alone: a key/value block and its gradient sum, both ways."""
    kv = torch.randn((2, rows, *shape), dtype=dtype, device=device)
    dkv = torch.randn((2, rows, *shape), dtype=torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype,
                      device=device)
    outs = [torch.empty_like(kv), torch.empty_like(dkv)]
    to, frm = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, kv, to), dist.P2POp(dist.irecv, outs[0], frm),
           dist.P2POp(dist.isend, dkv, to), dist.P2POp(dist.irecv, outs[1], frm)]
    dist.barrier()
    start = time.perf_counter()
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    _sync(device)
    return time.perf_counter() - start


def _worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    result: dict[str, Any] = {}
    try:
        if args.device == "cpu":
            torch.set_num_threads(1)
        device = torch.device(args.device if args.device == "cpu" else f"cuda:{rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.world, timeout=timedelta(seconds=300))
        world = args.world
        if args.check:
            result["check_max_rel_diff"] = _check(rank, world, device)
        dtype = getattr(torch, args.dtype)
        rows = []
        for tokens in args.tokens:
            layout = RingLayout(samples=(SampleShape(tokens=tokens),), ulysses_degree=1, ring_degree=world,
                                index_in_group=rank)
            local = layout.ring_tokens(rank)
            gen = torch.Generator().manual_seed(tokens)
            q, k, v, g = (torch.randn(local, args.heads, args.head_dim, generator=gen).to(device=device, dtype=dtype)
                          for _ in range(4))
            times: dict[str, list[float]] = {"forward": [], "backward_sync": [], "backward_overlap": [], "hop": []}
            for rep in range(args.warmup + args.repeats):
                for overlap in ((False, True) if rep % 2 == 0 else (True, False)):
                    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
                    dist.barrier()
                    _sync(device)
                    start = time.perf_counter()
                    out = ring_attention(qq, kk, vv, layout=layout, group=dist.group.WORLD, causal=True,
                                         overlap_backward=overlap)
                    _sync(device)
                    forward_s = time.perf_counter() - start
                    dist.barrier()
                    start = time.perf_counter()
                    out.backward(g)
                    _sync(device)
                    backward_s = time.perf_counter() - start
                    forward_s, backward_s = _slowest(forward_s, backward_s, device=device)
                    if rep >= args.warmup:
                        times["forward"].append(forward_s)
                        times["backward_overlap" if overlap else "backward_sync"].append(backward_s)
                if world > 1:
                    rows_max = max(layout.ring_tokens(j) for j in range(world))
                    hop = _hop_s(rows_max, (args.heads, args.head_dim), rank=rank, world=world, dtype=dtype,
                                 device=device)
                    if rep >= args.warmup:
                        times["hop"].append(_slowest(hop, device=device)[0])
            kv_bytes = 2 * local * args.heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
            ratios = [o / s for o, s in zip(times["backward_overlap"], times["backward_sync"], strict=True)]
            rows.append({"tokens": tokens, "block_tokens": local, "kv_bytes_per_hop": kv_bytes,
                         **{f"{name}_s": statistics.median(ts) if ts else None for name, ts in times.items()},
                         "overlap_over_sync_paired": statistics.median(ratios),
                         "overlap_over_sync_range": [min(ratios), max(ratios)], "samples_s": times})
        result["rows"] = rows
        dist.destroy_process_group()
    except Exception:
        result["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks in the ring")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192], help="tokens of the sample")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare with plain attention (fp64) first")
    parser.add_argument("--out", type=Path, default=default_out("ring_overlap"))
    args = parser.parse_args()
    if args.world < 1:
        parser.error(f"--world {args.world}: need at least one rank")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        parser.error(f"--world {args.world} needs as many GPUs; torch sees {torch.cuda.device_count()}")
    for t in args.tokens:
        if t < 2 * args.world:
            parser.error(f"--tokens {t}: a ring of {args.world} needs at least {2 * args.world} tokens")
    from provenance import provenance

    from dcp_cli.net import free_port
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(args, free_port(), out_dir), nprocs=args.world, join=True)
        results = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(args.world)]
    load_end = os.getloadavg()
    for r, res in enumerate(results):
        if "error" in res:
            raise SystemExit(f"rank {r} failed:\n{res['error']}")
    rows = results[0]["rows"]  # every rank holds the same slowest-rank times
    check = max((res.get("check_max_rel_diff", 0.0) for res in results), default=0.0) if args.check else None
    print(f"ring of {args.world} ({args.backend}, {args.device}, {args.dtype}), H={args.heads} Dh={args.head_dim}, "
          f"medians of {args.repeats}; load {load_start[0]:.1f} -> {load_end[0]:.1f} on {os.cpu_count()} cores")
    if check is not None:
        print(f"check: ring vs plain attention (fp64, both schedules): max relative diff {check:.2e}")
    print(f"{'tokens':>7} {'block':>6} {'fwd ms':>8} {'bwd sync ms':>11} {'bwd ovl ms':>10} {'ovl/sync':>8} "
          f"{'(min-max)':>11} {'hop ms':>7} {'hidable':>7}")
    for row in rows:
        low, high = row["overlap_over_sync_range"]
        hop = (f"{row['hop_s'] * 1e3:>7.2f} {(args.world - 1) * row['hop_s'] / row['backward_sync_s']:>7.1%}"
               if row["hop_s"] is not None else f"{'-':>7} {'-':>7}")
        print(f"{row['tokens']:>7} {row['block_tokens']:>6} {row['forward_s'] * 1e3:>8.1f} "
              f"{row['backward_sync_s'] * 1e3:>11.1f} {row['backward_overlap_s'] * 1e3:>10.1f} "
              f"{row['overlap_over_sync_paired']:>8.3f} {low:>5.2f}-{high:<5.2f} {hop}")
    print("ovl/sync: median over repeats of overlapped / synchronous backward, run back to back (min-max); hop: one "
          "backward step's transfers alone (kv + gradient sum); hidable: (r - 1) hops / synchronous backward, "
          "about the most the overlap can save")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        **provenance(), "world": args.world, "backend": args.backend, "device": args.device, "dtype": args.dtype,
        "heads": args.heads, "head_dim": args.head_dim, "repeats": args.repeats, "warmup": args.warmup,
        "loadavg_start": load_start, "loadavg_end": load_end, "cpus": os.cpu_count(),
        "torch": torch.__version__, "check_max_rel_diff": check, "rows": rows,
        "not_measured": "NCCL on GPUs unless backend=nccl; a fused attention kernel (blocks are plain matmuls); "
                        "the Ulysses all-to-alls (u = 1)"}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
