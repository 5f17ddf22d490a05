"""Merge ``bench/plan_quality.py`` runs over disjoint workloads into one grid JSON.

On a shared machine the full grid (every workload, 20 steps a cell) may not get a core to itself
for the hour it needs; it can instead run as one process per workload (``--workloads W --out
PART``), all at once, each still timing its own plans on the one core it is pinned to. Every
section of the JSON is per workload (grid cells, step rows, statuses by workload, budgets,
ablation), so the parts concatenate into what one process would have written, in its order.
What differs is recorded: ``command`` says how the parts ran, ``parts`` keeps each part's
command, commit and machine, the load is the highest any part saw at its start and end, and
``rss`` is the largest peak of the parts' probes (each part probes the same batch).

    .venv/bin/python bench/merge_plan_quality.py /tmp/pq_*.json --out bench/results/plan_quality.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAME = ("batches", "steps", "clusters", "default_config")
"""Fields every part must share: a merge of different grids is refused."""


def merge(parts: list[dict[str, Any]], *, how: str) -> dict[str, Any]:
    """One grid JSON from parts over disjoint workloads.

    Args:
        parts: Parsed ``plan_quality.py`` JSONs.
        how: The ``command`` of the merged JSON (how the parts were run and merged).

    Raises:
        ValueError: naming the field when the parts differ in batches, steps, clusters or
            configuration, a workload two parts both ran, or a part that is not a finished grid.
    """
    if not parts:
        raise ValueError("no parts to merge")
    for field in SAME:
        values = {json.dumps(p.get(field)) for p in parts}
        if len(values) != 1:
            raise ValueError(f"parts differ in {field!r}: {sorted(values)}")
    workloads: list[str] = []
    for p in parts:
        for key in ("grid", "grid_rows", "budgets", "machine", "workloads"):
            if key not in p:
                raise ValueError(f"part {p.get('command')!r} has no {key!r}: not a finished plan_quality.py run")
        repeated = set(workloads) & set(p["workloads"])
        if repeated:
            raise ValueError(f"workloads {sorted(repeated)} are in more than one part")
        workloads += p["workloads"]
    order = {w: i for i, w in enumerate(sorted(workloads))}
    parts = sorted(parts, key=lambda p: order[p["workloads"][0]])
    workloads = sorted(workloads, key=order.__getitem__)
    first = parts[0]
    commits = sorted({str(p.get("git_commit")) for p in parts})
    loads = {edge: [max(p["machine"][edge][i] for p in parts) for i in range(3)]
             for edge in ("loadavg_at_start", "loadavg_at_end")}
    merged: dict[str, Any] = {
        "command": how,
        "git_commit": commits[0] if len(commits) == 1 else " / ".join(commits),
        "machine": {"platform": first["machine"]["platform"], "python": first["machine"]["python"],
                    "cpu_count": first["machine"]["cpu_count"],
                    "pinned": ", ".join(sorted({str(p["machine"].get("pinned")) for p in parts})) + " (one per part)",
                    **loads},
        **{field: first[field] for field in SAME},
        "workloads": workloads,
        "parts": [{"workloads": p["workloads"], "command": p.get("command"), "git_commit": p.get("git_commit"),
                   "machine": p["machine"]} for p in parts],
    }
    if all("by_workload" in p for p in parts):
        merged["by_workload"] = [w for p in parts for w in p["by_workload"]]
    merged["grid"] = [c for p in parts for c in p["grid"]]
    merged["grid_rows"] = {k: v for p in parts for k, v in p["grid_rows"].items()}
    budgets = [b for p in parts for b in p["budgets"]]
    budget_order = {b: i for i, b in enumerate(sorted({b["budget_s"] for b in budgets}))}
    merged["budgets"] = sorted(budgets, key=lambda b: (budget_order[b["budget_s"]], order[b["workload"]]))
    if all("ablation" in p for p in parts):
        merged["ablation"] = [a for p in parts for a in p["ablation"]]
    probes = [p["rss"] for p in parts if "rss" in p]
    if probes:
        merged["rss"] = max(probes, key=lambda r: r["peak_rss_bytes"])
        merged["rss_parts"] = probes
    merged["self_peak_rss_bytes"] = max(p.get("self_peak_rss_bytes", 0) for p in parts)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="+", type=Path, help="plan_quality.py JSONs over disjoint workloads.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--how", default=None,
                        help="The merged JSON's command (default: the parts' commands, joined).")
    args = parser.parse_args()
    try:
        parts = [json.loads(path.read_text(encoding="utf-8")) for path in args.parts]
        how = args.how or "; ".join(str(p.get("command")) for p in parts)
        merged = merge(parts, how=how)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"merge_plan_quality: {exc}\n")
        sys.exit(2)
    args.out.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    sys.stdout.write(f"wrote {args.out}: {len(merged['grid'])} cells, workloads {', '.join(merged['workloads'])}\n")


if __name__ == "__main__":
    main()
