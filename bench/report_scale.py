"""How long one plan's pictures take at 64 to 1,024 GPUs: Gantt PNG and SVG (with hover text),
the plan's HTML page, the memory chart and the trace JSON.

Each point plans one step of text-longtail (4 samples per GPU, the default preset) on an H200
world of that size, then times each picture ``--repeats`` times (CPU and wall clock; the median
is reported). The target (issue 26): every picture of a 1,024-GPU plan in under 5 s.

Run from the repository root::

    .venv/bin/python bench/report_scale.py                  # about a minute on 2 shared cores

It prints a table and writes ``--out`` (default ``bench-out/report_scale.json``) (with the commit and load).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from costmodel.evaluate import CostModel  # noqa: E402
from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from planner.memory_view import plan_memory  # noqa: E402
from planner.planning import plan_batch  # noqa: E402
from planner.timeline import step_timeline  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402
from report.figures import PlanPictureInput  # noqa: E402
from report.memory import memory_image  # noqa: E402
from report.plan_html import plan_html  # noqa: E402
from report.plan_report import plan_image  # noqa: E402
from report.trace import plan_trace_json  # noqa: E402

logger = logging.getLogger("report_scale")

WORKLOAD = "text-longtail"
TARGET_S = 5.0


def _timed(make: Callable[[], Any], repeats: int) -> tuple[float, float, int]:
    """Median CPU and wall seconds of ``make`` and the size of what it returned."""
    cpu, wall, size = [], [], 0
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        out = make()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
        size = len(out)
    return statistics.median(cpu), statistics.median(wall), size


def measure(num_gpus: int, *, repeats: int) -> dict[str, Any]:
    """Every picture of one planned step at ``num_gpus``."""
    spec = WorkloadSpec.preset(WORKLOAD)
    cluster = load_cluster(f"h200x{num_gpus}")
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    plan = plan_batch(sample_batch(spec, num_samples=4 * num_gpus, seed=0, step=0), cluster=cluster,
                      cost_model=file, reference_sample=spec.max_sample)
    cm = CostModel(file=file, cluster=cluster)
    data = PlanPictureInput(plan=plan, cost_model=cm, baseline=None, label=WORKLOAD)
    svg = plan_image(data, "svg")
    hbm = cluster.hardware.hbm_bytes
    memory_svg = memory_image(plan_memory(plan, cm), title="memory", hbm_bytes=hbm, fmt="svg")
    pictures: dict[str, Callable[[], Any]] = {
        "gantt_png": lambda: plan_image(data, "png"),
        "gantt_svg": lambda: plan_image(data, "svg"),
        "plan_html": lambda: plan_html(title="plan", gantt_svg=plan_image(data, "svg"), memory_svg=memory_svg),
        "memory_png": lambda: memory_image(plan_memory(plan, cm), title="memory", hbm_bytes=hbm, fmt="png"),
        "trace_json": lambda: plan_trace_json(plan, step_timeline(plan, cm)),
    }
    row: dict[str, Any] = {"num_gpus": num_gpus, "num_samples": 4 * num_gpus, "num_groups": len(plan.groups),
                           "num_micro_batches": sum(len(g.micro_batches) for g in plan.groups),
                           "svg_bytes": len(svg)}
    for name, make in pictures.items():
        cpu_s, wall_s, size = _timed(make, repeats)
        row[name] = {"cpu_s": cpu_s, "wall_s": wall_s, "bytes": size}
    return row


def main() -> None:
    """Measure, print, write the JSON."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=default_out("report_scale"))
    args = parser.parse_args()
    load_start = os.getloadavg()
    rows = [measure(n, repeats=args.repeats) for n in args.gpus]
    names = ("gantt_png", "gantt_svg", "plan_html", "memory_png", "trace_json")
    logger.info("%-6s %7s %7s  %s", "GPUs", "groups", "mbs", "  ".join(f"{n:>11}" for n in names))
    for r in rows:
        logger.info("%-6d %7d %7d  %s", r["num_gpus"], r["num_groups"], r["num_micro_batches"],
                    "  ".join(f"{r[n]['wall_s']:>9.2f} s" for n in names))
    worst = max(r[n]["wall_s"] for r in rows for n in names)
    logger.info("slowest picture: %.2f s wall (target %.0f s)", worst, TARGET_S)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, check=False).stdout.strip() or None
    record = {"commit": commit, "workload": WORKLOAD, "repeats": args.repeats, "loadavg_start": load_start,
              "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(), "target_s": TARGET_S,
              "slowest_wall_s": worst, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from provenance import provenance  # bench/, the script's folder, is on sys.path

    args.out.write_text(json.dumps({**provenance(), **record}, indent=1) + "\n")
    logger.info("wrote %s", args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out)


if __name__ == "__main__":
    main()
