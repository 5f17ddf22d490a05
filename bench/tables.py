"""The figure tables of the docs (README.md, bench/README.md, docs/*.md), rendered from
``bench/results/*.json``.

Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in a doc; this
script writes what ``TABLES[NAME]`` renders from its JSON there, with a first line naming the
JSON and the commit the benchmark ran at (the ``git_commit`` its script stored, or "commit not
recorded"). A JSON written from a tree with uncommitted changes (``-dirty``) is refused, and a
path of the machine that ran it is shown by its file name only. ``tests/test_doc_tables.py``
fails when a doc's table differs from the rendering.

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

from refusals import fully_refused, refusal_note  # bench/, the script's folder, is on sys.path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = (ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md")))
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/-])/(?:tmp|work|home|root|Users|mnt|srv|scratch)/[^\s`|;,)]*")
"""A path of the machine that ran a benchmark (a scratch directory, a checkout), as a result may hold it."""
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


def _refusable(item: dict[str, Any], head: list[str], *, width: int,
               figures: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """A row of ``width`` cells: ``head`` (the cells naming the item), then ``figures(item)``; a partly
    refused item's last head cell adds its refused steps (``bench/refusals.py``), and one with no
    planned step shows the refusal in place of figures."""
    note = refusal_note(item)
    if fully_refused(item):
        return [*head, note, *["-"] * (width - len(head) - 1)]
    if note:
        head = [*head[:-1], f"{head[-1]} ({note})"]
    return [*head, *figures(item)]


def _grid(data: dict[str, Any]) -> list[str]:
    head = ["workload", "GPUs", "batch", "x bucket-sp4", "x bucket-best", "x static-best",
            "x megatron-dyncp", "x dcp-greedy", "x naive", "**x strongest** (min)", "ceiling",
            "BASELINE / POLISHED steps", "gap to LP bound mean / p95", "compute-only gap mean / p95",
            "CPU p50 / p95 ms"]
    lines = [_row(head), "|---|" + "---:|" * (len(head) - 1)]
    for c in data["grid"]:
        lines.append(_row(_refusable(c, [c["workload"], _gpus(c["cluster"]), str(c["num_samples"])],
                                     width=len(head), figures=_grid_figures)))
    return lines


def _grid_figures(c: dict[str, Any]) -> list[str]:
    """A grid cell's figures (``_grid``'s columns after the batch)."""
    size = (c.get("bucket_best_size") or "-").removeprefix("bucket-")
    statuses = c.get("statuses", {})
    return [
        _x(c["speedup_bucket-sp4_mean"]),
        f"{_x(c['speedup_bucket-best_mean'])} ({size})", _x(c["speedup_static-best_mean"]),
        _x(c["speedup_megatron-dyncp_mean"]), _x(c["speedup_dcp-greedy_mean"]), _x(c["speedup_naive_mean"]),
        f"**{_x(c['speedup_strongest_mean'])}** ({_x(c['speedup_strongest_min'])})",
        _x(c["ceiling_strongest_mean"]),
        f"{statuses.get('BASELINE', 0)} / {statuses.get('POLISHED_BASELINE', 0)}",
        f"{_pct(c['gap_lp_mean'])} / {_pct(c['gap_lp_p95'])}",
        f"{_pct(c['gap_lp_compute_mean'])} / {_pct(c['gap_lp_compute_p95'])}",
        f"{_ms(c['cpu_p50_s'])} / {_ms(c['cpu_p95_s'])}",
    ]


def _budget(value_s: float) -> str:
    return f"{value_s:g} s"


def _budgets(data: dict[str, Any]) -> list[str]:
    head = ["budget", "workload", "gap to LP bound mean / p95", "x strongest", "CPU p50 / p95 ms",
            "wall p50 / p95 ms", "steps CP-SAT improved", "CP-SAT gain mean (max)", "LNS rounds kept / run"]
    lines = [_row(head), "|---:|---|" + "---:|" * (len(head) - 2)]
    for c in data["budgets"]:
        lines.append(_row(_refusable(c, [_budget(c["budget_s"]), c["workload"]], width=len(head),
                                     figures=_budget_figures)))
    return lines


def _budget_figures(c: dict[str, Any]) -> list[str]:
    """A budget cell's figures (``_budgets``' columns after the workload), over its planned steps."""
    planned = c.get("planned_steps", c["steps"])
    return [
        f"{_pct(c['gap_lp_mean'])} / {_pct(c['gap_lp_p95'])}",
        _x(c["speedup_strongest_mean"]), f"{_ms(c['cpu_p50_s'])} / {_ms(c['cpu_p95_s'])}",
        f"{_ms(c['latency_p50_s'])} / {_ms(c['latency_p95_s'])}",
        f"{round(c['cpsat_improved_share'] * planned)} / {planned}",
        f"{_pct(c['cpsat_gain_mean'] - 1)} ({_pct(c['cpsat_gain_max'] - 1)})",
        f"{c['lns_improved_rounds']} / {c['lns_rounds']}",
    ]


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
        lines.append(_row(_refusable(w, [w["workload"]], width=len(head), figures=_status_figures)))
    return lines


def _status_figures(w: dict[str, Any]) -> list[str]:
    """A workload's steps by status (``_statuses``' columns after the workload)."""
    gain = ("-" if w["polish_gain_mean"] is None
            else f"{_pct(w['polish_gain_mean'] - 1)} ({_pct(w['polish_gain_max'] - 1)})")
    return [str(w["steps"]), str(w["search_steps"]), str(w["baseline_steps"]), str(w["polished_steps"]),
            f"{w['search_beat_strongest_steps']} of {w['steps']}", gain]


def _points(gap: float | None, reference: float | None) -> str:
    """A gap's difference to another, in percentage points (signed)."""
    return "-" if gap is None or reference is None else f"{(gap - reference) * 100:+.2f}"


def _layouts(data: dict[str, Any]) -> list[str]:
    head = ["workload", "GPUs", "batch", "layout", "steps planned / valid", "step time s (mean)",
            "**x strongest** (under auto)", "x strongest of this layout", "x ring-cp", "x usp",
            "gap to bound (mean)", "gap - ulysses' gap (points)", "steps with a wrong bound dropped",
            "steps with groups past the heads", "auto x this layout", "planning CPU s (p50)"]
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
                _points(m["gap_mean"], s["ulysses"]["gap_mean"]) if mode != "ulysses" else "-",
                str(m["dropped_bound_steps"]), str(m["groups_past_heads_steps"]),
                "-" if mode == "auto" else _x(s.get(f"auto_over_{mode}_mean")),
                "-" if m.get("cpu_p50_s") is None else f"{m['cpu_p50_s']:.3f}",
            ]))
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
    """The 1-minute load average at the run's start and end, wherever its script recorded them."""
    machine = data.get("machine", {})
    pairs = (("loadavg_at_start", "loadavg_at_end"), ("loadavg_start", "loadavg_end"),
             ("load_avg_start", "load_avg_end"), ("loadavg_before", "loadavg_after"),
             ("host_load_avg_start", "host_load_avg_end"))
    for start_key, end_key in pairs:
        start = machine.get(start_key) or data.get(start_key)
        end = machine.get(end_key) or data.get(end_key)
        if start and end:
            return f"load {start[0]:.1f} -> {end[0]:.1f}"
    for key in ("loadavg", "load_average", "loadavg_1m_at_start"):
        value = machine.get(key) or data.get(key)
        if value:
            return f"load {(value[0] if isinstance(value, list) else value):.1f}"
    return "load not recorded"


Cell = str | Callable[[dict[str, Any]], str]
"""A column's cell: a ``str.format_map`` template over the row (``{p50_ms:.1f}``) or a function."""


def _columns(rows: Callable[[dict[str, Any]], list[dict[str, Any]]], columns: list[tuple[str, Cell]], *,
             left: int = 1, refusable: int = 0) -> Callable[[dict[str, Any]], list[str]]:
    """A renderer of one table row per item of ``rows(data)``; the first ``left`` columns
    (text) left-aligned, the others (numbers) right-aligned. With ``refusable``, an item's
    refused steps are shown after its first ``refusable`` columns (``_refusable``)."""
    def cells(r: dict[str, Any], part: list[tuple[str, Cell]]) -> list[str]:
        return [cell.format_map(r) if isinstance(cell, str) else cell(r) for _, cell in part]

    def render(data: dict[str, Any]) -> list[str]:
        lines = [_row([head for head, _ in columns]), "|" + "---|" * left + "---:|" * (len(columns) - left)]
        for r in rows(data):
            lines.append(_row(_refusable(r, cells(r, columns[:refusable]), width=len(columns),
                                         figures=lambda item: cells(item, columns[refusable:]))
                              if refusable else cells(r, columns)))
        return lines
    return render


def _mve_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """``bench/model_vs_executor.py``'s runs, one row per model kind and run."""
    rows = []
    for kind, runs in data["runs"].items():
        for i, run in enumerate(runs if isinstance(runs, list) else [runs], 1):
            s = run["summary"]
            one = s["by_group_size"].get("1", {})
            rows.append({"kind": kind, "run": i, **s, "one": one,
                         "load": (run.get("loadavg_after") or [None])[0]})
    return rows


def _d1(r: dict[str, Any]) -> str:
    one = r["one"]
    if not one.get("micro_batches"):
        return "-"
    return f"{one['time_s_sum'] * 1e3:.0f} / {one['predicted_rest_s'] * 1e3:.0f} ms"


MODEL_VS_EXECUTOR = _columns(_mve_rows, [
    ("model", "{kind}"), ("run", "{run}"), ("micro-batches", "{micro_batches}"),
    ("**time MAPE** (bias)", lambda r: f"**{_pct(r['time_mape'])}** ({r['time_bias']:+.1%})"),
    ("per group", lambda r: _pct(r["group_time_mape"])), ("d=1 measured / predicted", _d1),
    ("peak MAPE (max)", lambda r: f"{_pct(r['peak_mape'])} ({_pct(r['peak_max_error'])})"),
    ("load after", lambda r: "-" if r["load"] is None else f"{r['load']:.1f}"),
])


def _overhead_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    res = data["results"]
    rows = [{"mode": mode, "part": part, **res[key][part]} for key, mode in (("depth4", "prefetch 4 steps"),
                                                                              ("depth0", "no prefetch"))
            for part in ("fetch", "digest", "total")]
    rows += [{"mode": f"measurements ({clock})", "part": "timer + reporter", **res["measure"][key]}
             for key, clock in (("wall", "wall"), ("thread_cpu", "thread CPU"))]
    return [*rows, {"mode": "after a barrier", "part": "digest", **res["digest_after_barrier"]}]


def _named(key: str) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """Rows from ``data[key]``: a list as it is, a dict as ``{"name": key, **value}`` per item."""
    def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
        value = data[key]
        return value if isinstance(value, list) else [{"name": k, **v} for k, v in value.items()]
    return rows


def _recal_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """``bench/recalibration.py``'s errors per revision, then after step 20, then the offline model's."""
    rows = [{"name": "the wrong model" if rev == "0" else f"revision @{rev}", **e}
            for rev, e in data["errors_by_revision"].items()]
    after = data["errors_from_step_20"]
    offline = data["comparison"]
    return [*rows, {"name": "**every plan of steps >= 20**", **after},
            {"name": "the offline-fitted model itself, same steps", "groups": "-", "group_mape": None,
             "group_median_ape": None, "micro_batch_mape": offline["offline_micro_batch_mape"]}]


def _nested(*keys: str) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
        for key in keys:
            data = data[key]
        return data if isinstance(data, list) else [data]
    return rows


def _fit_cell(term: str) -> Cell:
    """A fitted term's held-out MAPE on the default split (the mean over splits)."""
    return lambda r: f"{_pct(r['mape'][term])} ({_pct(r['mape_mean_over_splits'][term])})"


def _picture_cell(key: str) -> Cell:
    """A picture's wall seconds (its size in KiB)."""
    return lambda r: f"{r[key]['wall_s']:.2f} ({r[key]['bytes'] / 1024:.0f})"


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


TABLES: dict[str, TableSpec] = {
    "plan-quality": TableSpec(json_name="plan_quality.json", render=_grid),
    "plan-statuses": TableSpec(json_name="plan_quality.json", render=_statuses),
    "plan-quality-budgets": TableSpec(json_name="plan_quality.json", render=_budgets),
    "plan-intra-ablation": TableSpec(json_name="plan_quality.json", render=_columns(_named("ablation"), [
        ("workload", "{workload}"), ("GPUs", lambda r: _gpus(r["cluster"])), ("batch", "{num_samples}"),
        ("inter only / inter + intra, mean", "{intra_gain_mean:.4f}"), ("max", "{intra_gain_max:.4f}"),
        ("steps faster", "{steps_faster} / {steps}"), ("x strongest inter only", "{inter_only_x_strongest:.3f}"),
        ("x strongest inter + intra", "{both_x_strongest:.3f}")], refusable=3)),
    "plan-quality-modern": TableSpec(json_name="plan_quality_modern.json", render=_grid),
    **{name: TableSpec(json_name=json_name, render=_columns(_named("grid"), [
        ("model", lambda r: r["workload"].partition("@")[2] or r["workload"]), ("cluster", "{cluster}"),
        ("batch", "{num_samples}"), ("gap to the plan's bound, mean", lambda r: _pct(r["gap_mean"])),
        ("gap to the LP bound, mean", lambda r: _pct(r["gap_lp_mean"])),
        ("**x strongest**", lambda r: f"**{_x(r['speedup_strongest_mean'])}**")], left=2, refusable=3))
       for name, json_name in (("plan-quality-moe", "plan_quality_moe.json"),
                               ("plan-quality-gemma", "plan_quality_gemma.json"))},
    "plan-quality-layouts": TableSpec(json_name="plan_quality_layouts.json", render=_layouts),
    "plan-scale-sweeps": TableSpec(json_name="plan_scale.json", render=_scale_sweeps),
    "plan-scale-readme": TableSpec(json_name="plan_scale_points_5steps_rerun.json", render=_scale_points),
    "plan-scale-layouts": TableSpec(json_name="plan_scale_layouts.json", render=_scale_points_gap),
    "plan-scale-layouts-16384": TableSpec(json_name="plan_scale_layouts_16384.json",
                                          render=_scale_points_gap),
    "plan-phases-16384-2c3dc7a": TableSpec(json_name="plan_phases_16384_auto_2c3dc7a_ab1.json", render=_plan_phases),
    "executor-overhead": TableSpec(json_name="executor_overhead.json", render=_columns(_overhead_rows, [
        ("mode", "{mode}"), ("part", "{part}"), ("median ms", "{median_ms:.3f}"), ("p99 ms", "{p99_ms:.2f}")],
        left=2)),
    **{name: TableSpec(json_name=json_name, render=MODEL_VS_EXECUTOR) for name, json_name in (
        ("model-vs-executor", "model_vs_executor_cpu.json"),
        ("model-vs-executor-quiet", "model_vs_executor_cpu_quiet.json"),
        ("model-vs-executor-one-at-a-time", "model_vs_executor_cpu_one_at_a_time.json"),
        ("model-vs-executor-gqa", "model_vs_executor_cpu_gqa.json"),
    )},
    "communicators": TableSpec(json_name="communicators.json", render=_columns(_named("rows"), [
        ("world", "{world}"), ("groups (contiguous)", "{contiguous_groups}"), ("groups (aligned)", "{aligned_groups}"),
        ("create contiguous s", lambda r: f"{r['contiguous_create_s_max']:.3f}" if r["ran"] else "not run"),
        ("create aligned s", lambda r: f"{r['aligned_create_s_max']:.3f}" if r["ran"] else "not run"),
        ("first all-reduce per group, median ms",
         lambda r: f"{r['first_collective_ms_median']:.1f}" if r["ran"] else "not run")])),
    "ring-cost": TableSpec(json_name="ring_cost.json", render=_columns(_named("rows"), [
        ("tokens", "{tokens:,}"), ("group", "{group_size}"), ("Ulysses x ring", "{ulysses_degree} x {ring_degree}"),
        ("forward ms", lambda r: f"{r['forward_s'] * 1e3:.2f}"),
        ("ring adds ms", lambda r: f"{r['exposed_forward_s'] * 1e3:.2f}"),
        ("all-to-all ms", lambda r: f"{r['alltoall_forward_s'] * 1e3:.2f}"),
        ("ring K/V buffers MiB", lambda r: _mib(r["ring_kv_buffer_bytes"]))])),
    "loss-chunk": TableSpec(json_name="loss_chunk.json", render=_columns(_named("predicted"), [
        ("loss chunk", lambda r: f"{r['loss_chunk_tokens']:,} tokens" if r["loss_chunk_tokens"] else "whole logits"),
        ("group", "{group_size}"), ("model states GiB", lambda r: f"{r['model_state_bytes'] / 2**30:.2f}"),
        ("fixed working GiB (loss chunk)",
         lambda r: f"{r['fixed_working_bytes'] / 2**30:.2f} ({r['loss_chunk_bytes'] / 2**30:.2f})"),
        ("activations GiB", lambda r: f"{r['activation_bytes'] / 2**30:.2f}"),
        ("**peak per rank GiB**", lambda r: f"**{r['peak_bytes'] / 2**30:.2f}**"),
        ("cap GiB", lambda r: f"{r['memory_cap_bytes'] / 2**30:.2f}"), ("fits", lambda r: "yes" if r["fits"] else "no"),
        ("sample s", lambda r: f"{r['time_s']:.1f}")])),
    "saved-bytes": TableSpec(json_name="saved_bytes.json", render=_columns(_named("rows"), [
        ("model", "{model}"), ("block", "{block}"), ("tokens", "{tokens:,}"), ("policy", "{policy}"),
        ("counted bytes", "{counted_bytes:,}"), ("predicted bytes", "{predicted_bytes:,.0f}"),
        ("ratio", "{ratio:.4f}"), ("formula of the kind", "{generic_ratio:.3f}")])),
    "executor-peak-real": TableSpec(json_name="executor_peak_real.json", render=_columns(_named("rows"), [
        ("model", "{model}"), ("tokens", lambda r: ", ".join(f"{t:,}" for t in r["tokens"])),
        ("policies", lambda r: ", ".join(str(k) for k in r["policies"])),
        ("measured peak MiB", lambda r: f"{r['measured_peak_bytes'] / 2**20:.2f}"),
        ("predicted MiB", lambda r: f"{r['predicted_peak_bytes'] / 2**20:.2f}"), ("ratio", "{ratio:.4f}"),
        ("formula of the kind", "{generic_ratio:.4f}")])),
    "profile-fit": TableSpec(json_name="profile_fit.json", render=_columns(_named("rows"), [
        ("model shape", "{model}"), ("timing", "{timing}"),
        *[(f"{term.replace('_', ' ')} (mean over splits)",
           _fit_cell(term))
          for term in ("compute_time", "activation_bytes", "head_time", "alltoall", "allreduce")],
        ("profile s", "{profile_wall_s:.0f}")], left=2)),
    "profile-fit-unforced": TableSpec(json_name="profile_fit_unforced.json", render=_columns(_named("rows"), [
        ("model shape", "{model}"), ("timing", "{timing}"),
        *[(f"{term.replace('_', ' ')} (mean over splits)", _fit_cell(term))
          for term in ("compute_time", "activation_bytes", "peak_bytes", "head_time", "alltoall", "allreduce")],
        ("fit without --force", lambda r: "accepted" if r["unforced"]["accepted"] else "**refused**")], left=2)),
    "fit-free": TableSpec(json_name="fit_free.json", render=_columns(_named("rows"), [
        ("model", "{model}"), ("peak structure", "{structure}"), ("noise", "{noise:.0%}"),
        ("fit without --force", lambda r: "accepted" if r["accepted"] else "**refused**"),
        ("held-out peak MAPE", lambda r: _pct(r["heldout_peak_mape"])),
        ("full-depth peak error, max", lambda r: _pct(r["full_depth_peak_error_max"])),
        ("diagnosis", "{diagnosis}")], left=2)),
    "megatron-parity": TableSpec(json_name="megatron_parity.json", render=_columns(_nested("summary"), [
        ("batches", "{batches}"), ("compared", "{compared}"), ("Megatron failed", "{megatron_failed}"),
        ("ours / Megatron min", "{ratio_min:.2f}"), ("median", "{ratio_median:.2f}"), ("max", "{ratio_max:.2f}"),
        ("ours slower by over 2%", "{ours_slower_by_over_2pct}")])),
    "service-load-fetch": TableSpec(json_name="service_load_rerun.json", render=_columns(_named("fetch"), [
        ("clients", "{clients}"), ("order", "{order}"), ("mode", "{mode}"), ("requests", "{requests:,}"),
        ("errors", "{errors}"), ("req/s", "{throughput_rps:,.0f}"), ("p50 ms", "{p50_ms:.1f}"),
        ("p99 ms", "{p99_ms:.1f}"), ("max ms", "{max_ms:.1f}")], left=3)),
    "faults": TableSpec(json_name="faults.json", render=_columns(_named("cases"), [
        ("fault", "{name}"), ("what the user sees", "{user_sees}"), ("recovered in s", "{recovery_s:.2f}"),
        ("steps", "{steps}"), ("plans identical to a clean run", lambda r: _yes(r["identical_to_reference"]))],
        left=2)),
    "fuzz": TableSpec(json_name="fuzz.json", render=_columns(_named("runs"), [
        ("mode", "{mode}"), ("fuzzing s", "{elapsed_s:.0f}"),
        ("test cases generated / passed", lambda r: f"{r['test_cases'].get('generated', 0):,} / "
                                                    f"{r['test_cases'].get('passed', 0):,}"),
        ("requests the server counted", "{requests:,}"), ("5xx", "{server_5xx}"),
        ("tracebacks", "{server_tracebacks}"),
        ("raw-socket probes x rounds (failures)",
         lambda r: f"{r['raw_phase']['probes']} x {r['raw_phase']['rounds']} ({r['raw_phase']['num_failures']})"),
        ("passed", lambda r: _yes(r["passed"]))])),
    "plan-budget": TableSpec(json_name="plan_budget.json", render=_columns(_named("rows"), [
        ("workload", lambda r: r["cell"].split(":")[0]), ("cluster", lambda r: r["cell"].split(":")[1]),
        ("samples", lambda r: r["cell"].split(":")[2]), ("CPU p50 ms", lambda r: _ms(r["cpu_p50_s"])),
        ("CPU max ms", lambda r: _ms(max(r["cpu_s"]))), ("mean gap to own bound", lambda r: _pct(r["gap_mean"]))],
        left=2)),
    "epoch-scale": TableSpec(json_name="epoch_scale.json", render=_columns(_named("runs"), [
        ("runner", "{kind}"), ("workers", "{workers}"), ("steps", "{steps}"), ("steps/s", "{steps_per_s:.1f}"),
        ("driver CPU ms / step", lambda r: f"{r['driver_cpu_s_per_step'] * 1e3:.2f}"),
        ("all CPU ms / step", lambda r: f"{r['all_cpu_s_per_step'] * 1e3:.1f}"),
        ("digests equal the pool's", lambda r: _yes(r["digests_equal_pool"]))])),
    "epoch-ray-faults": TableSpec(json_name="epoch_ray_faults.json", render=_columns(_named("cases"), [
        ("fault", "{case}"), ("steps stored at the fault", lambda r: str(r.get("steps_at_fault", "-"))),
        ("done s after it", lambda r: f"{r.get('after_fault_s', r['total_s']):.1f}"), ("state", "{state}"),
        ("distinct steps", lambda r: str(r.get("distinct_steps", "-"))),
        ("digests equal the pool's", lambda r: _yes(r["digests_equal_pool"]) if "digests_equal_pool" in r else "-")])),
    "recalibration-fitted": TableSpec(json_name="recalibration_fitted_stepgc1.json", render=_columns(_recal_rows, [
        ("plans of", "{name}"), ("groups", "{groups}"), ("group MAPE", lambda r: _pct(r["group_mape"])),
        ("group median APE", lambda r: _pct(r["group_median_ape"])),
        ("micro-batch MAPE", lambda r: _pct(r["micro_batch_mape"]))])),
    "report-scale": TableSpec(json_name="report_scale.json", render=_columns(_named("rows"), [
        ("GPUs x samples", "{num_gpus} x {num_samples}"), ("groups", "{num_groups}"),
        *[(f"{name} s (KiB)", _picture_cell(key))
          for key, name in (("gantt_png", "Gantt PNG"), ("gantt_svg", "Gantt SVG"), ("plan_html", "plan HTML"),
                            ("memory_png", "memory PNG"), ("trace_json", "trace JSON"))]])),
}
"""Every generated table by its marker name."""


def _command(command: str, json_name: str) -> str:
    """The recorded command as a reader reruns it: an absolute ``--out`` path (a scratch file the
    result was copied from) becomes the committed file, any other absolute path its file name."""
    words = command.split()
    for i, word in enumerate(words):
        if word.startswith("/"):
            words[i] = f"bench/results/{json_name}" if i and words[i - 1] == "--out" else Path(word).name
    return " ".join(words)


def render(name: str) -> str:
    """The table ``name`` as the docs hold it between its markers (ending in a newline).

    Raises:
        KeyError: for a name ``TABLES`` does not know.
        ValueError: when its JSON was written from a tree with uncommitted changes (``-dirty``):
            such a figure cannot be traced to code anyone can check out.
    """
    spec = TABLES[name]
    data = json.loads((RESULTS / spec.json_name).read_text(encoding="utf-8"))
    commit = data.get("git_commit") or data.get("commit") or "commit not recorded"
    if commit.endswith("dirty"):
        raise ValueError(f"table {name!r}: bench/results/{spec.json_name} ran at {commit}, a tree with uncommitted "
                         "changes; rerun it at a clean commit (--out bench/results/...)")
    if commit != "commit not recorded":
        commit = f"commit {commit}"
    command = _command(data.get("command", "command not recorded"), spec.json_name)
    source = (f"*Generated by `bench/tables.py` from `bench/results/{spec.json_name}` ({commit}; `{command}`, "
              f"{_load(data)}).*")
    body = "\n".join([source, "", *spec.render(data)]) + "\n"
    return ABSOLUTE_PATH.sub(lambda m: Path(m.group(0)).name, body)


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
