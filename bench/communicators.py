"""Process groups a plan may use: how many, and how long creating them takes, per world size.

Spawns a gloo world of N CPU processes (one thread each) and, on every rank, creates the
groups two ways, timing each on the calling thread's wall clock (the max over ranks is
reported): ``contiguous`` = what :class:`executor.groups.GroupRegistry` creates today (every
contiguous block of every allowed size > 1: the planner's placement may start a group at any
rank) and ``aligned`` = only blocks that start at a multiple of their size. It then times the
first all-reduce on each group this rank belongs to (gloo connects lazily). World sizes whose
processes do not fit this machine (each rank imports torch: ~250 MB) are counted, not run.
Prints a table and writes ``--out`` (default ``bench-out/communicators.json``).

Run::

    .venv/bin/python bench/communicators.py --worlds 8 16 32 --sizes 2 4 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from executor.groups import GroupRegistry

logger = logging.getLogger(__name__)


def count_groups(world: int, sizes: list[int], *, aligned: bool) -> int:
    """Groups of sizes > 1: every contiguous block, or only the aligned ones."""
    return sum(world // s if aligned else world - s + 1 for s in sizes if 1 < s <= world)


def _rank(rank: int, world: int, sizes: list[int], init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    dist.barrier()
    registry = GroupRegistry(world_size=world, rank=rank, group_sizes=[1, *sizes])
    dist.barrier()
    start = time.perf_counter()
    mine = []
    for s in sizes:
        for first in range(0, world - s + 1, s):
            ranks = list(range(first, first + s))
            group = dist.new_group(ranks=ranks)
            if rank in ranks:
                mine.append(group)
    aligned_s = time.perf_counter() - start
    dist.barrier()
    first_s = []
    for group in mine:  # the aligned groups this rank is in: first collective (gloo connects lazily)
        t = time.perf_counter()
        dist.all_reduce(torch.ones(1), group=group)
        first_s.append(time.perf_counter() - t)
    result = {"contiguous_groups": registry.num_groups, "contiguous_s": registry.creation_time_s,
              "aligned_s": aligned_s, "first_collective_s": first_s}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, sizes: list[int]) -> dict[str, Any]:
    """Spawn a world of ``world`` ranks and gather each rank's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        start = time.perf_counter()
        mp.spawn(_rank, args=(world, sizes, init_file, tmp), nprocs=world, join=True)
        spawn_s = time.perf_counter() - start
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    firsts = [t for r in ranks for t in r["first_collective_s"]]
    return {
        "world": world, "ran": True, "spawn_s": spawn_s,
        "contiguous_groups": ranks[0]["contiguous_groups"],
        "aligned_groups": count_groups(world, sizes, aligned=True),
        "contiguous_create_s_max": max(r["contiguous_s"] for r in ranks),
        "aligned_create_s_max": max(r["aligned_s"] for r in ranks),
        "first_collective_ms_median": 1e3 * sorted(firsts)[len(firsts) // 2] if firsts else 0.0,
    }


def main() -> None:
    """Run the worlds that fit, count the others, print a table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32], help="World sizes to run.")
    parser.add_argument("--count-only", type=int, nargs="+", default=[64, 128],
                        help="World sizes only counted (too many processes for this machine).")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="Allowed group sizes > 1.")
    parser.add_argument("--out", type=Path, default=default_out("communicators"), help="JSON output.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = [run_world(w, args.sizes) for w in args.worlds]
    rows += [{"world": w, "ran": False, "contiguous_groups": count_groups(w, args.sizes, aligned=False),
              "aligned_groups": count_groups(w, args.sizes, aligned=True)} for w in args.count_only]
    print(f"{'world':>5} {'contig':>6} {'aligned':>7} {'contig s':>9} {'aligned s':>9} {'1st coll ms':>11}")
    for r in rows:
        if r["ran"]:
            print(f"{r['world']:>5} {r['contiguous_groups']:>6} {r['aligned_groups']:>7} "
                  f"{r['contiguous_create_s_max']:>9.3f} {r['aligned_create_s_max']:>9.3f} "
                  f"{r['first_collective_ms_median']:>11.2f}")
        else:
            print(f"{r['world']:>5} {r['contiguous_groups']:>6} {r['aligned_groups']:>7} {'(counted)':>9}")
    print("contig/aligned: process groups of sizes", args.sizes, "(every contiguous block / aligned blocks); "
          "s: creation time, max over ranks (wall); 1st coll: median first all-reduce per group and rank")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        **provenance(), "rows": rows, "sizes": args.sizes, "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(), "backend": "gloo"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
