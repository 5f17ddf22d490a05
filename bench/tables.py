"""The figure tables of README.md and bench/README.md, rendered from ``bench/results/*.json``.

Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in a doc; this
script writes what ``TABLES[NAME]`` renders from its JSON there, with a first line naming the
JSON and the commit the benchmark ran at (the ``git_commit`` its script stored, or "commit not
recorded"). ``tests/test_doc_tables.py`` fails when a doc's table differs from the rendering.

    .venv/bin/python bench/tables.py            # rewrite every marked table in place
    .venv/bin/python bench/tables.py --check    # exit 1 naming each table that differs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = (ROOT / "README.md", ROOT / "bench" / "README.md")
MARKER = re.compile(r"(<!-- table:([a-z0-9_-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSpec:
    """One generated table: the JSON it reads and how it renders."""

    json_name: str
    render: Callable[[dict[str, Any]], list[str]]


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1e3:.0f}"


def _gpus(cluster: str) -> str:
    return cluster.rpartition("x")[2]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _grid(data: dict[str, Any]) -> list[str]:
    head = ["workload", "GPUs", "batch", "x bucket-sp4", "x bucket-best", "x static-best",
            "x megatron-dyncp", "x dcp-greedy", "x naive", "**x strongest** (min)", "ceiling",
            "BASELINE / POLISHED steps", "gap to LP bound mean / p95", "compute-only gap mean / p95",
            "CPU p50 / p95 ms"]
    lines = [_row(head), "|---|" + "---:|" * (len(head) - 1)]
    for c in data["grid"]:
        size = (c.get("bucket_best_size") or "-").removeprefix("bucket-")
        statuses = c.get("statuses", {})
        lines.append(_row([
            c["workload"], _gpus(c["cluster"]), str(c["num_samples"]), _x(c["speedup_bucket-sp4_mean"]),
            f"{_x(c['speedup_bucket-best_mean'])} ({size})", _x(c["speedup_static-best_mean"]),
            _x(c["speedup_megatron-dyncp_mean"]), _x(c["speedup_dcp-greedy_mean"]), _x(c["speedup_naive_mean"]),
            f"**{_x(c['speedup_strongest_mean'])}** ({_x(c['speedup_strongest_min'])})",
            _x(c["ceiling_strongest_mean"]),
            f"{statuses.get('BASELINE', 0)} / {statuses.get('POLISHED_BASELINE', 0)}",
            f"{_pct(c['gap_lp_mean'])} / {_pct(c['gap_lp_p95'])}",
            f"{_pct(c['gap_lp_compute_mean'])} / {_pct(c['gap_lp_compute_p95'])}",
            f"{_ms(c['cpu_p50_s'])} / {_ms(c['cpu_p95_s'])}",
        ]))
    return lines


def _budget(value_s: float) -> str:
    return f"{value_s:g} s"


def _budgets(data: dict[str, Any]) -> list[str]:
    head = ["budget", "workload", "gap to LP bound mean / p95", "x strongest", "CPU p50 / p95 ms",
            "wall p50 / p95 ms", "steps CP-SAT improved", "CP-SAT gain mean (max)", "LNS rounds kept / run"]
    lines = [_row(head), "|---:|---|" + "---:|" * (len(head) - 2)]
    for c in data["budgets"]:
        improved = round(c["cpsat_improved_share"] * c["steps"])
        lines.append(_row([
            _budget(c["budget_s"]), c["workload"], f"{_pct(c['gap_lp_mean'])} / {_pct(c['gap_lp_p95'])}",
            _x(c["speedup_strongest_mean"]), f"{_ms(c['cpu_p50_s'])} / {_ms(c['cpu_p95_s'])}",
            f"{_ms(c['latency_p50_s'])} / {_ms(c['latency_p95_s'])}", f"{improved} / {c['steps']}",
            f"{_pct(c['cpsat_gain_mean'] - 1)} ({_pct(c['cpsat_gain_max'] - 1)})",
            f"{c['lns_improved_rounds']} / {c['lns_rounds']}",
        ]))
    return lines


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.0f}"


def _scale_sweeps(data: dict[str, Any]) -> list[str]:
    lines = [_row(["workload", "sweep", "GPUs x samples: CPU p50 s (RSS MiB)", "b"]), "|---|---|---|---:|"]
    for sweep in data["sweeps"]:
        points = "; ".join(f"{r['num_gpus']} x {r['num_samples']}: {r['cpu_p50_s']:.2f} ({_mib(r['peak_rss_bytes'])})"
                           for r in sweep["rows"])
        lines.append(_row([sweep["workload"], sweep["sweep"], points, _x(sweep.get("cpu_exponent"))]))
    return lines


def _scale_points(data: dict[str, Any]) -> list[str]:
    lines = [_row(["workload", "GPUs x samples", "CPU s per step", "p50", "RSS MiB"]), "|---|---|---|---:|---:|"]
    for sweep in data["sweeps"]:
        for r in sweep["rows"]:
            lines.append(_row([r["workload"], f"{r['num_gpus']} x {r['num_samples']}",
                               ", ".join(f"{t:.2f}" for t in r["cpu_s"]), f"**{r['cpu_p50_s']:.2f}**",
                               _mib(r["peak_rss_bytes"])]))
    return lines


def _scale_points_gap(data: dict[str, Any]) -> list[str]:
    """``_scale_points`` with each point's mean gap to its lower bound."""
    lines = [_row(["workload", "GPUs x samples", "CPU s per step", "p50", "gap", "RSS MiB"]),
             "|---|---|---|---:|---:|---:|"]
    for sweep in data["sweeps"]:
        for r in sweep["rows"]:
            lines.append(_row([r["workload"], f"{r['num_gpus']} x {r['num_samples']}",
                               ", ".join(f"{t:.2f}" for t in r["cpu_s"]), f"**{r['cpu_p50_s']:.2f}**",
                               _pct(r["gap_mean"]), _mib(r["peak_rss_bytes"])]))
    return lines


def _statuses(data: dict[str, Any]) -> list[str]:
    head = ["workload", "steps", "search (HEURISTIC / FEASIBLE / OPTIMAL)", "BASELINE", "POLISHED_BASELINE",
            "search alone beat strongest", "polishing gain mean (max)"]
    lines = [_row(head), "|---|" + "---:|" * (len(head) - 1)]
    for w in data["by_workload"]:
        gain = ("-" if w["polish_gain_mean"] is None
                else f"{_pct(w['polish_gain_mean'] - 1)} ({_pct(w['polish_gain_max'] - 1)})")
        lines.append(_row([w["workload"], str(w["steps"]), str(w["search_steps"]), str(w["baseline_steps"]),
                           str(w["polished_steps"]), f"{w['search_beat_strongest_steps']} of {w['steps']}", gain]))
    return lines


def _layouts(data: dict[str, Any]) -> list[str]:
    head = ["workload", "GPUs", "batch", "layout", "steps planned / valid", "step time s (mean)",
            "**x strongest** (under auto)", "x strongest of this layout", "x ring-cp", "x usp",
            "gap to bound (mean)", "steps with a wrong bound dropped", "steps with groups past the heads",
            "auto x this layout"]
    lines = [_row(head), "|---|---:|---:|---|" + "---:|" * (len(head) - 4)]
    for cell in data["cells"]:
        s = cell["summary"]
        for mode in data["modes"]:
            m = s[mode]
            step = "-" if m["step_time_mean_s"] is None else f"{m['step_time_mean_s']:.3f}"
            lines.append(_row([
                f"{s['workload']} ({s['heads']} heads)", _gpus(s["cluster"]), str(s["num_samples"]), mode,
                f"{m['feasible_steps']} / {m['valid_steps']} of {s['steps']}", step,
                f"**{_x(m['speedup_strongest_mean'])}**", _x(m["speedup_own_strongest_mean"]),
                _x(m["speedup_ring-cp_mean"]), _x(m["speedup_usp_mean"]), _pct(m["gap_mean"]),
                str(m["dropped_bound_steps"]), str(m["groups_past_heads_steps"]),
                "-" if mode == "auto" else _x(s.get(f"auto_over_{mode}_mean")),
            ]))
    return lines


def _rankview(data: dict[str, Any]) -> list[str]:
    head = ["run", "connections", "requests", "req/s", "p50 ms", "p90 ms", "**p99 ms**", "errors",
            "server RSS MiB after (main / with solver)", "load 1 min before"]
    before = data["rss_before"]
    lines = [_row(head), "|---" + "|---:" * (len(head) - 1) + "|",
             _row(["before", "-", "-", "-", "-", "-", "-", "-",
                   f"{before['main_bytes'] / 2**20:.1f} / {before['with_children_bytes'] / 2**20:.1f}", "-"])]
    for r in data["runs"]:
        errors = sum(r["socket_errors"].values()) + r["non_2xx_3xx"]
        rss = r["rss_after"]
        lines.append(_row([str(r["run"]), str(r.get("connections", data["connections"])), f"{r['requests']:,}",
                           f"{r['requests_per_s']:,.0f}", f"{r['p50_s'] * 1e3:.1f}", f"{r['p90_s'] * 1e3:.1f}",
                           f"**{r['p99_s'] * 1e3:.1f}**", str(errors),
                           f"{rss['main_bytes'] / 2**20:.1f} / {rss['with_children_bytes'] / 2**20:.1f}",
                           f"{r['load_avg_1m_before']:.1f}"]))
    return lines


def _plan_phases(data: dict[str, Any]) -> list[str]:
    """One plan's CPU seconds by phase (``bench/plan_phases.py``); nested phases overlap."""
    lines = [f"{data['workload']} {data['num_gpus']} x {data['num_samples']}, layout={data['layout']}, "
             f"step {data['step']}: **CPU {data['cpu_s']:.2f} s**, predicted step time "
             f"{data['predicted_step_time_s']:.6f} s, gap {data['gap']:.2%}", "",
             _row(["phase", "CPU s", "calls"]), "|---|---:|---:|"]
    lines += [_row([p["phase"], f"{p['cpu_s']:.2f}", str(p["calls"])]) for p in data["phases"]
              if p["cpu_s"] >= 0.1]
    return lines


def _load(data: dict[str, Any]) -> str:
    machine = data.get("machine", {})
    start, end = machine.get("loadavg_at_start"), machine.get("loadavg_at_end")
    return f"load {start[0]:.1f} -> {end[0]:.1f}" if start and end else "load not recorded"


TABLES: dict[str, TableSpec] = {
    "plan-scale-sweeps": TableSpec(json_name="plan_scale.json", render=_scale_sweeps),
    "plan-scale-points": TableSpec(json_name="plan_scale_points_5steps.json", render=_scale_points),
    "plan-scale-readme": TableSpec(json_name="plan_scale_points_5steps_rerun.json", render=_scale_points),
    "plan-scale-layouts": TableSpec(json_name="plan_scale_layouts.json", render=_scale_points_gap),
    # Issue 25's 16,384 x 131,072 point (`plan_scale.py --layout auto`) and its phase breakdowns
    # (`plan_phases.py`) over the rounds of speed-ups: the table's name -> its JSON.
    **{name: TableSpec(json_name=json_name, render=_scale_points_gap) for name, json_name in (
        ("plan-scale-layouts-16384", "plan_scale_layouts_16384_quiet_93250d0_ab.json"),
        ("plan-scale-layouts-16384-quiet-f5e2b91-ab", "plan_scale_layouts_16384_quiet_f5e2b91_ab.json"),
        ("plan-scale-layouts-16384-5f03d76", "plan_scale_layouts_16384.json"),
        ("plan-scale-layouts-16384-lptmemo", "plan_scale_layouts_16384_lptmemo.json"),
        ("plan-scale-layouts-16384-microopt", "plan_scale_layouts_16384_microopt.json"),
        ("plan-scale-layouts-16384-packed", "plan_scale_layouts_16384_packed.json"),
        ("plan-scale-layouts-16384-quiet", "plan_scale_layouts_16384_quiet.json"),
        ("plan-scale-layouts-16384-quiet-d25f763", "plan_scale_layouts_16384_quiet_d25f763.json"),
        ("plan-scale-layouts-16384-2c3dc7a", "plan_scale_layouts_16384_2c3dc7a_ab1.json"),
        ("plan-scale-layouts-16384-f5e2b91", "plan_scale_layouts_16384_f5e2b91_ab1.json"),
    )},
    **{name: TableSpec(json_name=json_name, render=_plan_phases) for name, json_name in (
        ("plan-phases-16384-before-lptmemo", "plan_phases_16384_auto_dc65cb4_ab2.json"),
        ("plan-phases-16384-lptmemo", "plan_phases_16384_auto_lptmemo_ab2.json"),
        ("plan-phases-16384-f5e2b91", "plan_phases_16384_auto_f5e2b91_ab1.json"),
        ("plan-phases-16384-2c3dc7a", "plan_phases_16384_auto_2c3dc7a_ab1.json"),
    )},
    "plan-quality-grid": TableSpec(json_name="plan_quality.json", render=_grid),
    "plan-quality-budgets": TableSpec(json_name="plan_quality.json", render=_budgets),
    "plan-quality-24-48": TableSpec(json_name="plan_quality_24_48.json", render=_grid),
    "plan-statuses": TableSpec(json_name="plan_quality.json", render=_statuses),
    "plan-quality-layouts": TableSpec(json_name="plan_quality_layouts.json", render=_layouts),
    "load-rankview": TableSpec(json_name="load_rankview.json", render=_rankview),
}
"""Every generated table by its marker name."""


def render(name: str) -> str:
    """The table ``name`` as the docs hold it between its markers (ending in a newline).

    Raises:
        KeyError: for a name ``TABLES`` does not know.
    """
    spec = TABLES[name]
    data = json.loads((RESULTS / spec.json_name).read_text(encoding="utf-8"))
    commit = data.get("git_commit") or "commit not recorded"
    if commit != "commit not recorded":
        commit = f"commit {commit}"
    source = (f"*Generated by `bench/tables.py` from `bench/results/{spec.json_name}` ({commit}; "
              f"`{data.get('command', 'command not recorded')}`, {_load(data)}).*")
    return "\n".join([source, "", *spec.render(data)]) + "\n"


def marked_tables(text: str) -> list[tuple[str, str]]:
    """``(name, body)`` of every marked table in ``text``, in order."""
    return [(m.group(2), m.group(3)) for m in MARKER.finditer(text)]


def rewrite(text: str) -> str:
    """``text`` with every marked table replaced by its rendering."""
    return MARKER.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def main() -> None:
    """Rewrite the docs' tables, or with ``--check`` name the ones that differ (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Only compare; exit 1 when a table differs.")
    args = parser.parse_args()
    stale = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            stale += [f"{doc.relative_to(ROOT)}: {name}" for (name, body), (_, fresh)
                      in zip(marked_tables(text), marked_tables(new), strict=True) if body != fresh]
            if not args.check:
                doc.write_text(new, encoding="utf-8")
    if args.check and stale:
        sys.stderr.write("tables that differ from their JSON:\n  " + "\n  ".join(stale) + "\n")
        sys.exit(1)
    sys.stdout.write(("rewrote " if stale else "up to date: ") + (", ".join(stale) or "every table") + "\n")


if __name__ == "__main__":
    main()
