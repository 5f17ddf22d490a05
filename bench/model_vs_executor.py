"""Benchmark: the cost model against the executor, per micro-batch and per group, on this CPU.

Run from the repository root::

    .venv/bin/python bench/model_vs_executor.py                  # 1D and 2D, thread clock (~6 min)
    .venv/bin/python bench/model_vs_executor.py --clock wall     # needs a quiet machine
    .venv/bin/python bench/model_vs_executor.py --kinds 1d,3d --kv-heads 1 \
        --out bench/results/model_vs_executor_cpu_gqa.json        # groups past the key/value head

For each reference model of the executor (``executor.models``: LLaMA-style 1D, STDiT-style 2D;
4 layers, hidden 64, 4 heads, fp32) it runs ``dcp_cli.model_check.run_check`` (what
``dcp check-model`` runs): profile the executor's own layers as one rank of groups of 1 and 2
(all-to-all emulated by a local copy), profile all-to-all / all-reduce on 2 gloo ranks, fit,
plan 3 steps of 8 random samples (32..2048 tokens) for a ``cpu:2`` cluster whose memory fits
about 600 tokens without checkpointing, run every micro-batch on 2 gloo ranks and compare.
Prints one line per model and run and writes ``--out`` (default ``bench-out/model_vs_executor_cpu.json``)
(``runs``: the reports of each kind, one per ``--runs``).

Targets (issue 9): per-micro-batch time MAPE <= 10% for 1D and 2D, peak memory within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dcp_cli.model_check import CheckConfig, run_check
from dcp_cli.progress import make_progress

ROOT = Path(__file__).resolve().parents[1]


def _commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                         capture_output=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, text=True,
                           capture_output=True, check=False).stdout.strip()
    return (out + ("+dirty" if dirty else "")) or None


def _cpu_times_s() -> dict[str, float] | None:
    """Machine-wide CPU seconds by kind from /proc/stat (Linux), to say how busy the box was and
    how much time the hypervisor took (``steal``) during a run; None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    tick = os.sysconf("SC_CLK_TCK")
    return {name: int(value) / tick for name, value in zip(names, fields, strict=False)}


def _fit_quality(report: dict[str, Any]) -> dict[str, float]:
    return {k: round(v["mape"], 3) for k, v in report["cost_model"]["fit_quality"].items()}


def main() -> None:
    """Run the check for each kind; print a summary line each; write the JSON."""
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="1d,2d")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens-max", type=int, default=2048)
    parser.add_argument("--memory-tokens", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="Key/value heads of the reference models' self-attention (0 = the 4 query heads; "
                             "1: groups of 2 replicate it, grouped-query attention past the key/value heads)")
    parser.add_argument("--no-concurrent", action="store_true",
                        help="profile in one process and run one-rank groups in turns (the GPU way)")
    parser.add_argument("--runs", type=int, default=1,
                        help="Repeat the whole check (profile, fit, plan, run) this many times per kind")
    parser.add_argument("--out", type=Path, default=default_out("model_vs_executor_cpu"))
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="No progress bar or stage lines: the summary lines only.")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "command": " ".join(["bench/model_vs_executor.py", *sys.argv[1:]]), "git_commit": _commit(),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "loadavg_at_start": os.getloadavg()},
        "runs": {},
    }
    kinds = args.kinds.split(",")
    bar = make_progress(quiet=args.quiet, transient=True)
    task = bar.add_task(f"checking {len(kinds)} kind(s)", total=len(kinds) * args.runs)
    bar.start()
    for kind, run_index in [(k, i) for i in range(args.runs) for k in kinds]:
        config = CheckConfig(kind=kind, clock=args.clock, num_steps=args.steps,  # type: ignore[arg-type]
                             samples_per_step=args.samples, tokens_max=args.tokens_max,
                             memory_tokens=args.memory_tokens, repeats=args.repeats,
                             sweep_repeats=args.repeats, concurrent=not args.no_concurrent,
                             ffn_hidden=128 if kind == "1d" else 256, num_kv_heads=args.kv_heads or None)
        start, cpu_before = time.perf_counter(), _cpu_times_s()
        report = run_check(config, progress=lambda text: None if args.quiet else print(f"  {text}", file=sys.stderr))
        report["wall_s"] = time.perf_counter() - start
        report["loadavg_after"] = os.getloadavg()
        cpu_after = _cpu_times_s()
        if cpu_before is not None and cpu_after is not None:
            report["machine_cpu_s"] = {k: round(cpu_after[k] - cpu_before[k], 2) for k in cpu_after}
        results["runs"].setdefault(kind, []).append(report)
        s = report["summary"]
        sizes = sorted({r["group_size"] for r in report["micro_batches"]})
        mode = "concurrent" if config.concurrent else "one at a time"
        steal = report.get("machine_cpu_s", {}).get("steal")
        print(f"{kind} run {run_index + 1}/{args.runs} ({args.clock} clock, {mode}): "
              f"{s['micro_batches']} micro-batches on group sizes {sizes}, "
              f"{s['checkpointed_micro_batches']} checkpointed ({s['mixed_policy_micro_batches']} mixed): "
              f"time MAPE {s['time_mape']:.1%} (bias {s['time_bias']:+.1%}), per group "
              f"{s['group_time_mape']:.1%}; peak MAPE {s['peak_mape']:.1%} (max {s['peak_max_error']:.1%}); "
              f"fit held-out MAPE {_fit_quality(report)}; "
              f"{report['wall_s']:.0f} s, load {report['loadavg_after'][0]:.1f}"
              + ("" if steal is None else f", steal {steal:.1f} s"))
        for d, g in s["by_group_size"].items():
            print(f"  d={d}: all-to-all {g['alltoall_s'] * 1e3:.1f} ms measured / "
                  f"{g['predicted_alltoall_s'] * 1e3:.1f} ms predicted, the rest {g['rest_s'] * 1e3:.1f} / "
                  f"{g['predicted_rest_s'] * 1e3:.1f} ms (sums over its micro-batches)"
                  + ("" if g.get("emulated_s") is None else
                     f"; on the emulated group {g['emulated_s'] * 1e3:.1f} ms (the compute model's "
                     f"{g['predicted_rest_s'] * 1e3:.1f}; all-to-alls add "
                     f"{(g['time_s_sum'] - g['emulated_s']) * 1e3:.1f}"
                     f" measured / {g['predicted_alltoall_s'] * 1e3:.1f} predicted)"))
        bar.advance(task)
    bar.stop()
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
