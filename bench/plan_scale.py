"""Planner latency and memory against batch size and world size (issue 10, item 5).

Three sweeps with the default preset (``PlannerConfig()``, the 50 ms budget at 256 x 32):
samples at a fixed world (``--fixed-gpus``), GPUs at a fixed batch (``--fixed-samples``), and
both together (8 samples per GPU, 32 x 256 up to 4,096 x 32,768). Every point runs in a fresh
process (its peak RSS is the planner's) and times ``plan_batch`` with the process CPU clock
(the machine is shared; wall time is reported too). Per sweep it fits the growth exponent
``b`` of ``cpu = a * x^b`` by least squares on the logs.

Run from the repository root::

    .venv/bin/python bench/plan_scale.py                 # ~5-10 minutes on 2 shared cores
    .venv/bin/python bench/plan_scale.py --quick         # the diagonal up to 1,024 x 8,192
    .venv/bin/python bench/plan_scale.py --points 1024x8192 4096x32768 --out ...  # just these
    .venv/bin/python bench/plan_scale.py --layout auto --points 256x32 1024x8192 ...  # layouts chosen

It prints a table per sweep and writes ``--out`` (default ``bench-out/plan_scale.json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("plan_scale")

_POINT = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from costmodel.presets import default_cost_model_file, load_cluster
from planner.config import PlannerConfig
from planner.planning import plan_batch
from planner.workload import WorkloadSpec, sample_batch
spec = WorkloadSpec.preset({workload!r})
base = load_cluster("h200x64")
cluster = base.model_copy(update={{"num_gpus": {gpus}, "name": "h200x{gpus}"}})
cmf = default_cost_model_file(spec.model, cluster.hardware.name)
cpu, wall, gaps = [], [], []
for step in range({steps}):
    samples = sample_batch(spec, num_samples={samples}, seed=0, step=step)
    c, w = time.process_time(), time.perf_counter()
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout={layout!r}),
                      reference_sample=spec.max_sample)
    cpu.append(time.process_time() - c)
    wall.append(time.perf_counter() - w)
    gaps.append(plan.gap)
print(json.dumps({{"cpu_s": cpu, "wall_s": wall, "gap": gaps,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def run_point(workload: str, gpus: int, samples: int, steps: int, layout: str = "ulysses") -> dict[str, Any]:
    """Plan ``steps`` batches in a fresh process under ``PlannerConfig(layout=layout)``; CPU and
    wall seconds, gaps, peak RSS."""
    code = _POINT.format(root=str(ROOT), workload=workload, gpus=gpus, samples=samples,
                         steps=steps, layout=layout)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return {"workload": workload, "num_gpus": gpus, "num_samples": samples, "steps": steps,
            "cpu_p50_s": float(np.median(data["cpu_s"])), "wall_p50_s": float(np.median(data["wall_s"])),
            "gap_mean": float(np.mean(data["gap"])), "peak_rss_bytes": data["peak_rss_bytes"],
            "cpu_s": data["cpu_s"], "wall_s": data["wall_s"]}


def parse_point(text: str) -> tuple[int, int]:
    """``"1024x8192"`` -> ``(1024, 8192)`` (GPUs, samples).

    Raises:
        ValueError: naming ``--points`` when the text is not two positive integers.
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--points: {text!r} is not GPUSxSAMPLES (e.g. 1024x8192)")
    return int(parts[0]), int(parts[1])


def growth_exponent(xs: list[float], ys: list[float]) -> float:
    """``b`` of the least-squares fit ``log y = log a + b log x``."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def sweep(name: str, workload: str, points: list[tuple[int, int]], x_of: str,
          steps_per_point: int | None = None, layout: str = "ulysses") -> dict[str, Any]:
    """Run every ``(gpus, samples)`` point (``steps_per_point`` steps, default 3 up to 2,048
    samples and 1 above); fit the exponent of CPU time in ``x_of``."""
    rows = []
    for gpus, samples in points:
        steps = steps_per_point or (3 if samples <= 2048 else 1)
        rows.append(run_point(workload, gpus, samples, steps, layout))
        r = rows[-1]
        logger.info("%s %s %d x %d: cpu %.3f s wall %.3f s rss %.0f MiB", name, workload, gpus,
                    samples, r["cpu_p50_s"], r["wall_p50_s"], r["peak_rss_bytes"] / 2**20)
    xs = [float(r[x_of]) for r in rows]
    exponent = (growth_exponent(xs, [r["cpu_p50_s"] for r in rows]) if len(set(xs)) > 1
                else float("nan"))
    return {"sweep": name, "workload": workload, "x": x_of, "rows": rows,
            "cpu_exponent": exponent}


def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="*", default=["text-longtail", "video-short"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fixed-gpus", type=int, default=256)
    parser.add_argument("--fixed-samples", type=int, default=8192)
    parser.add_argument("--points", nargs="*", default=None, metavar="GPUSxSAMPLES",
                        help="only these points (e.g. 1024x8192 4096x32768), as one 'points' "
                             "sweep per workload instead of the three sweeps")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per point (default: 3 up to 2,048 samples, 1 above)")
    parser.add_argument("--layout", choices=["ulysses", "auto", "ring"], default="ulysses",
                        help="PlannerConfig.layout: the attention layouts a group may take (default: the "
                             "default preset's, ulysses; auto: each group's Ulysses x ring chosen)")
    parser.add_argument("--out", type=Path, default=default_out("plan_scale"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    top = 1024 if args.quick else 4096
    diagonal = [(g, 8 * g) for g in (32, 64, 128, 256, 512, 1024, 2048, 4096) if g <= top]
    by_samples = [(args.fixed_gpus, n) for n in (256, 1024, 4096, 16384, 32768)
                  if n <= 8 * top and n >= args.fixed_gpus // 8]
    by_gpus = [(g, args.fixed_samples) for g in (32, 128, 512, 1024, 4096) if g <= top]
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                     capture_output=True, check=False).stdout.strip() or None,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "config": ("PlannerConfig() (default preset)" if args.layout == "ulysses"
                   else f"PlannerConfig(layout={args.layout!r}) (default preset, layouts chosen)"),
        "layout": args.layout, "sweeps": []}
    sweeps: tuple[tuple[str, list[tuple[int, int]], str], ...] = (
        ("diagonal", diagonal, "num_samples"),
        ("samples", [] if args.quick else by_samples, "num_samples"),
        ("gpus", [] if args.quick else by_gpus, "num_gpus"))
    if args.points is not None:
        sweeps = (("points", [parse_point(p) for p in args.points], "num_samples"),)
    for workload in args.workloads:
        for name, points, x_of in sweeps:
            if points:
                result["sweeps"].append(sweep(name, workload, points, x_of, args.steps, args.layout))
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    for s in result["sweeps"]:
        print(f"\n{s['workload']}, {s['sweep']} sweep: CPU time grows as {s['x']}^"
              f"{s['cpu_exponent']:.2f}")
        print(f"{'GPUs':>6s}{'samples':>9s}{'cpu p50 s':>11s}{'wall p50 s':>12s}{'gap':>8s}"
              f"{'RSS MiB':>9s}")
        for r in s["rows"]:
            print(f"{r['num_gpus']:6d}{r['num_samples']:9d}{r['cpu_p50_s']:11.3f}"
                  f"{r['wall_p50_s']:12.3f}{r['gap_mean'] * 100:7.2f}%"
                  f"{r['peak_rss_bytes'] / 2**20:9.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
