"""``megatron-dyncp`` against Megatron-Core 0.16.1's own ``BalancedCPScheduler``, step by step.

For random batches (96 samples, lengths ``2 ** U(lo, hi)`` tokens) on each cluster and model,
schedules the batch twice, costing both by the same cost-model seconds (each sample at its
cheapest fitting checkpoint policy on its group size; micro-batch packing left out on both sides):

* Megatron: ``get_groups_and_subsamples`` (its micro-batches, each regrouping the ranks, each
  ending in a barrier); a sample runs when all its ranks reach it, so a micro-batch lasts until
  its last rank finishes.
* Ours: ``planner.baselines.megatron_dyncp`` keeps one group layout for the step; the step is its
  most loaded group.

The ratio ours / Megatron above 1 is where our adaptation is weaker than Megatron's scheduler
(the speedup over ``megatron-dyncp`` then overstates the one over Megatron). Batches Megatron
cannot schedule on the cluster (a sample needing more ranks than there are; a micro-batch whose
groups grow to the whole cluster where the cost model allows no such size) are counted.
Needs megatron-core 0.16.1 (``make test`` installs it). Writes ``--out`` (default ``bench-out/megatron_parity.json``).

    .venv/bin/python bench/megatron_parity.py --seeds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from provenance import default_out, provenance  # noqa: E402  (bench/, the script's folder, is on sys.path)

from costmodel.presets import default_cost_model_file, load_cluster  # noqa: E402
from costmodel.specs import Sample  # noqa: E402
from planner.baselines.megatron_dyncp import max_tokens_per_rank, megatron_dyncp_draft  # noqa: E402
from planner.config import PlannerConfig  # noqa: E402
from planner.costs import CostTable  # noqa: E402
from planner.planning import prepare  # noqa: E402


class _Group:
    """The scheduler reads only the size of its DP x CP process group."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def megatron_step_s(table: CostTable, id_groups: list[list[list[int]]]) -> float:
    """Megatron's schedule in cost-model seconds: per micro-batch, each sample starts when all
    its ranks are free and have reached it; the micro-batch ends (barrier) at its last finish."""
    total = 0.0
    for ids in id_groups:
        ranks_of: dict[int, list[int]] = {}
        for rank, lst in enumerate(ids):
            for i in lst:
                ranks_of.setdefault(i, []).append(rank)
        free, pos = [0.0] * len(ids), [0] * len(ids)
        left = sum(len(lst) for lst in ids)
        while left:
            moved = False
            for rank, lst in enumerate(ids):
                if pos[rank] >= len(lst):
                    continue
                i = lst[pos[rank]]
                ranks = ranks_of[i]
                if all(pos[r] < len(ids[r]) and ids[r][pos[r]] == i for r in ranks):
                    end = max(free[r] for r in ranks) + table.sample_time(i, table.size_index(len(ranks)))
                    for r in ranks:
                        free[r], pos[r] = end, pos[r] + 1
                    left -= len(ranks)
                    moved = True
            if not moved:
                raise RuntimeError("Megatron's ranks wait on each other (orders disagree)")
        total += max(free)
    return total


def compare(cluster_name: str, model: str, log2_tokens: tuple[float, float], seed: int,
            num_samples: int) -> dict[str, Any]:
    """One batch: both step times (or why Megatron could not schedule it)."""
    import random

    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    rng = random.Random(seed)
    samples = [Sample(id=f"s{i}", tokens=int(2 ** rng.uniform(*log2_tokens))) for i in range(num_samples)]
    cluster = load_cluster(cluster_name)
    table = prepare(samples, cluster=cluster, cost_model=default_cost_model_file(model, "h200-sxm"),
                    config=PlannerConfig()).table
    row: dict[str, Any] = {"cluster": cluster_name, "model": model, "log2_tokens": list(log2_tokens),
                           "seed": seed}
    draft = megatron_dyncp_draft(table)
    assert draft is not None
    row["ours_s"] = max(sum(table.sample_time(i, table.size_index(g.size)) for mb in g.micro_batches
                            for i, _ in mb) for g in draft)
    row["ours_groups"] = [g.size for g in sorted(draft, key=lambda g: g.first_rank)]
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=max_tokens_per_rank(table),
                                    dp_cp_group=_Group(cluster.num_gpus))
    try:
        _, id_groups = scheduler.get_groups_and_subsamples([(i, s.tokens) for i, s in enumerate(table.samples)], None)
        row["megatron_s"] = megatron_step_s(table, id_groups)
        row["megatron_micro_batches"] = len(id_groups)
        row["ours_over_megatron"] = row["ours_s"] / row["megatron_s"]
    except (AssertionError, ValueError) as err:  # Megatron's own assert, or a size the cost model lacks
        row["megatron_error"] = f"{type(err).__name__}: {str(err).strip()}"
    return row


def main() -> None:
    """Run the comparison and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--num-samples", type=int, default=96)
    parser.add_argument("--out", type=Path, default=default_out("megatron_parity"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    cells = [(c, m, t) for c in ("h200x8", "h200x32", "h200x64") for m in ("llama-7b", "llama-3.1-8b")
             for t in ((9.0, 17.5), (8.0, 14.0))]
    rows = [compare(c, m, t, seed, args.num_samples) for c, m, t in cells for seed in range(args.seeds)]
    ratios = [r["ours_over_megatron"] for r in rows if "ours_over_megatron" in r]
    summary = {"batches": len(rows), "compared": len(ratios), "megatron_failed": len(rows) - len(ratios),
               "ratio_min": min(ratios), "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
               "ours_slower_by_over_2pct": sum(r > 1.02 for r in ratios)}
    for c, m, t in cells:
        cell = [r for r in rows if (r["cluster"], r["model"], tuple(r["log2_tokens"])) == (c, m, t)]
        got = [r["ours_over_megatron"] for r in cell if "ours_over_megatron" in r]
        print(f"{c:8s} {m:13s} 2^U{t}: " + (f"ours/megatron {min(got):.3f}-{max(got):.3f} over {len(got)}"
                                               if got else "-")
              + (f"; megatron failed on {len(cell) - len(got)}" if len(got) < len(cell) else ""))
    print(f"all: {summary}")
    result = {**provenance(), "num_samples": args.num_samples, "seeds": args.seeds,
              "loadavg": os.getloadavg(), "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
