"""Content digests of the default preset's plans on a fixed set of batches, to check a speed-up
leaves every plan bit-for-bit the same (issue 25: planning speed).

Plans each (workload, GPUs x samples, layout) case for steps 0-2 (seed 0, ``PlannerConfig``
defaults but the layout) and records each plan's ``Plan.content_digest()`` (every field but the
wall time) and predicted step time, with the command and commit (``bench/provenance.py``).
With ``--against`` (the JSON of another checkout's run, e.g. from a ``git worktree`` of the
previous commit) it lists the plans that differ and exits 1 if any.

Run from the repository root::

    .venv/bin/python bench/plan_digests.py --out /tmp/new.json --against /tmp/old.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from provenance import provenance  # noqa: E402  (bench/, the script's folder)

from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.planning import plan_batch  # noqa: E402
from planner.workload import WorkloadSpec, sample_batch  # noqa: E402

logger = logging.getLogger("plan_digests")

CASES = (
    ("text-longtail", 16384, 131072, "auto"),
    ("text-millionctx", 4096, 32768, "auto"),
    ("text-millionctx", 1024, 8192, "auto"),
    ("text-longtail", 1024, 8192, "ulysses"),
    ("video-short", 256, 2048, "auto"),
    ("text-longtail", 64, 256, "auto"),
    ("video3d-longclip", 64, 256, "auto"),
)
"""(workload, GPUs, samples, layout) of every checked batch."""


def plan_digests(*, cases: tuple[tuple[str, int, int, str], ...], steps: int) -> dict[str, dict[str, object]]:
    """Digest and predicted step time of each case's plans, keyed ``workload|GPUs|samples|layout|step``."""
    out: dict[str, dict[str, object]] = {}
    for workload, gpus, num_samples, layout in cases:
        spec = WorkloadSpec.preset(workload)
        cluster = load_cluster("h200x64").model_copy(update={"num_gpus": gpus, "name": f"h200x{gpus}"})
        cmf = default_cost_model_file(spec.model, cluster.hardware.name)
        for step in range(steps):
            samples = sample_batch(spec, num_samples=num_samples, seed=0, step=step)
            start = time.process_time()
            plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(layout=layout),
                              reference_sample=spec.max_sample)
            cpu_s = time.process_time() - start
            key = f"{workload}|{gpus}|{num_samples}|{layout}|{step}"
            out[key] = {"digest": plan.content_digest(), "step_time_s": plan.predicted_step_time_s, "cpu_s": cpu_s}
            logger.info("%s: %s %.6f s (planned in %.2f s CPU)", key, out[key]["digest"][:12],
                        plan.predicted_step_time_s, cpu_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--against", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    new = plan_digests(cases=CASES, steps=args.steps)
    args.out.write_text(json.dumps({**provenance(), "plans": new}, indent=1) + "\n")
    if args.against is None:
        return
    old = json.loads(args.against.read_text())["plans"]
    differ = [k for k in new if k not in old or old[k]["digest"] != new[k]["digest"]]
    for key in differ:
        logger.info("DIFFERS %s: %s", key, old.get(key))
    logger.info("%d of %d plans the same", len(new) - len(differ), len(new))
    if differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
