"""``dcp plan``: plan sampled batches of a workload preset and compare with the baselines."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.table import Table

from dcp_cli.model_option import loss_chunk_option, model_config_option, model_option, resolve_model
from dcp_cli.progress import progress_bar
from dcp_cli.style import console, fmt_pct, fmt_s, fmt_x, print_table

if TYPE_CHECKING:
    from costmodel.schema import CostModelFile
    from costmodel.specs import ModelSpec


LAYOUT_CHOICES = ("ulysses", "auto", "ring")
"""``--layout`` of ``dcp plan`` and ``dcp epoch`` (``PlannerConfig.layout``, ``planner/layouts.py``)."""


def plan_rows(*, workload: str, cluster: str, steps: int, seed: int, batch_size: int,
              budget_s: float, progress: Callable[[int, int | None], None] | None = None,
              cost_model_file: CostModelFile | None = None, model: ModelSpec | None = None,
              layout: str = "auto", loss_chunk_tokens: int | None = None,
              expert_parallel_size: int = 1) -> list[dict[str, Any]]:
    """One row per step: the plan's and every baseline's predicted step time, gap, latency.

    ``baselines_s`` and ``speedups`` also hold ``strongest``: the fastest baseline of the step
    but ``naive`` (``planner.baselines.strongest``). ``model`` (a preset or a config's spec)
    replaces the workload's model: with its analytic cost model on the cluster's hardware, or
    with ``cost_model_file`` when that file was fitted for a model of this very shape (models
    are matched by ``ModelSpec.shape_differences``, not by name: a ``config.json`` in any
    folder plans under a file fitted for its architecture). ``layout`` is ``PlannerConfig.layout``; each row's
    ``layouts`` lists its groups as ``[size, ulysses_degree, ring_degree]``, ``peak_mem_bytes``
    the plan's largest predicted peak per rank and ``memory_cap_bytes`` the cluster's cap.
    ``loss_chunk_tokens`` sets the model's LM loss chunk (``ModelSpec.loss_chunk_tokens``; the
    analytic cost model only: a fitted file charges the loss as it was profiled).
    ``expert_parallel_size`` splits a mixture-of-experts model's experts over that many ranks
    (``ClusterSpec.expert_parallel_size``: costed, not run by the executor).

    Raises:
        ValueError: for an unknown preset, a cost model made for another model shape (naming the
            fields that differ) or hardware (the workload's, or ``model`` when given), a model
            of the other kind than the workload (text/video), or a loss chunk that is negative,
            longer than the workload's longest sample or given with a cost-model file.
    """
    from costmodel.analytic import analytic_cost_model
    from costmodel.evaluate import CostModel
    from costmodel.model_choice import check_samples_kind, with_loss_chunk
    from costmodel.presets import default_cost_model_file, load_cluster, load_model
    from planner.baselines import strongest
    from planner.config import PlannerConfig
    from planner.planning import plan_batch
    from planner.workload import WorkloadSpec, sample_batch

    spec = WorkloadSpec.preset(workload)
    cluster_spec = load_cluster(cluster, **({"expert_parallel_size": expert_parallel_size}
                                            if expert_parallel_size != 1 else {}))
    if loss_chunk_tokens is not None:
        if cost_model_file is not None:
            raise ValueError(f"--loss-chunk-tokens {loss_chunk_tokens} applies to the analytic cost model; "
                             f"cost model {cost_model_file.id!r} charges the loss as it was profiled")
        model = with_loss_chunk(model if model is not None else load_model(spec.model), loss_chunk_tokens,
                                max_sample_tokens=spec.max_sample.tokens, option="--loss-chunk-tokens")
    if cost_model_file is not None and model is not None:
        differ = cost_model_file.model.shape_differences(model)
        if differ:
            raise ValueError(f"cost model {cost_model_file.id!r} is for model {cost_model_file.model.name!r} "
                             f"({_shape(cost_model_file.model)}), --model / --model-config names "
                             f"{model.name!r} ({_shape(model)}), another shape ({'; '.join(differ)}): "
                             f"give the model the file was fitted for, or leave it out to plan the "
                             f"workload's model {spec.model!r}")
        cost_model = cost_model_file  # matched by shape: the file describes this model whatever its name
        CostModel(file=cost_model, cluster=cluster_spec)  # hardware and sharding checks
    elif model is not None:
        cost_model = analytic_cost_model(model, cluster_spec.hardware)
    elif cost_model_file is None:
        cost_model = default_cost_model_file(spec.model, cluster_spec.hardware.name)
    else:
        cost_model = cost_model_file
        differ = cost_model.model.shape_differences(load_model(spec.model))
        if differ:
            raise ValueError(f"cost model {cost_model.id!r} is for model {cost_model.model.name!r}, "
                             f"workload {workload!r} trains {spec.model!r}, another shape "
                             f"({'; '.join(differ)}): fit one for "
                             f"{spec.model!r} (dcp profile --model {spec.model}; dcp fit), or name "
                             f"{cost_model.model.name!r} with --model / --model-config to plan the "
                             f"workload's samples under it")
        CostModel(file=cost_model, cluster=cluster_spec)  # hardware and sharding checks
    config = PlannerConfig.for_budget(budget_s, seed=seed, layout=layout)
    rows = []
    for step in range(steps):
        samples = sample_batch(spec, num_samples=batch_size, seed=seed, step=step)
        check_samples_kind(samples, cost_model.model, source=f"workload {workload!r} ({spec.kind})")
        start = time.perf_counter()
        plan = plan_batch(samples, cluster=cluster_spec, cost_model=cost_model, config=config,
                          step=step, reference_sample=spec.max_sample)
        latency = time.perf_counter() - start
        baselines_s = dict(plan.baselines_s)
        best = strongest(baselines_s)
        if best is not None:
            baselines_s["strongest"] = best[1]
        rows.append({
            "step": step,
            "num_samples": len(samples),
            "step_time_s": plan.predicted_step_time_s,
            "baselines_s": baselines_s,
            "speedups": {k: v / plan.predicted_step_time_s for k, v in baselines_s.items()},
            "lower_bound_s": plan.lower_bound.value_s,
            "bound_kind": plan.lower_bound.kind,
            "gap": plan.gap,
            "status": plan.solver.status,
            "method": plan.solver.method,
            "latency_s": latency,
            "group_sizes": sorted((g.size for g in plan.groups), reverse=True),
            "layouts": sorted(([g.size, g.ulysses_degree, g.ring_degree] for g in plan.groups), reverse=True),
            # per ring group, [size, u, r, what it saves against pure Ulysses of its size (null: none holds)]
            "ring_savings_s": sorted(([g.size, g.ulysses_degree, g.ring_degree, g.ring_saving_s]
                                      for g in plan.groups if g.ring_degree > 1), reverse=True),
            "peak_mem_bytes": max((mb.predicted_peak_mem_bytes for g in plan.groups for mb in g.micro_batches),
                                  default=0.0),
            "memory_cap_bytes": cluster_spec.memory_cap_bytes,
            "cost_model_id": plan.cost_model_id,
            "digest": plan.content_digest(),
        })
        if progress is not None:
            progress(step + 1, steps)
    return rows


def _shape(model: ModelSpec) -> str:
    """A model's shape in a message: layers, hidden size, query / key-value heads, FFN size."""
    return (f"{model.num_layers} layers, hidden {model.hidden}, {model.num_heads}/{model.kv_heads} heads, "
            f"ffn {model.ffn_hidden}")


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole-run figures: total time of the plans and of each baseline, throughput speedups.

    A baseline that cannot hold a step's batch (``naive`` at SP 1 beside a long sample) has no
    time for that step, so each baseline's figures are over the steps it planned:
    ``baselines_s`` its time over them, ``plans_s`` the plans' time over the same steps,
    ``speedups`` the one over the other, ``baseline_steps`` how many steps (of ``steps``).
    """
    plan_total = sum(r["step_time_s"] for r in rows)
    names = sorted({k for r in rows for k in r["baselines_s"]})
    planned = {k: [r for r in rows if k in r["baselines_s"]] for k in names}
    base = {k: sum(r["baselines_s"][k] for r in planned[k]) for k in names}
    plans = {k: sum(r["step_time_s"] for r in planned[k]) for k in names}
    return {
        "steps": len(rows),
        "step_time_s": plan_total,
        "baselines_s": base,
        "plans_s": plans,
        "baseline_steps": {k: len(planned[k]) for k in names},
        "speedups": {k: base[k] / plans[k] for k in names},
        "bound_kinds": dict(Counter(r["bound_kind"] for r in rows).most_common()),
        "gap_mean": sum(r["gap"] for r in rows) / len(rows),
        "gap_max": max(r["gap"] for r in rows),
        "latency_mean_s": sum(r["latency_s"] for r in rows) / len(rows),
        "latency_max_s": max(r["latency_s"] for r in rows),
    }


def register(app: typer.Typer) -> None:
    """Add ``dcp plan`` to the app."""

    @app.command("plan", short_help="Plan sampled batches of a workload preset; compare with the baselines.")
    def plan_command(
        workload: str = typer.Option(..., "--workload", "-w", help="Workload preset."),
        cluster: str = typer.Option(..., "--cluster", "-c", help="Cluster preset (or cpu:N, cpu:NxG)."),
        cost_model: Path | None = typer.Option(
            None, "--cost-model", help="A cost-model file (dcp fit) instead of the analytic default; "
                                      "its hardware must be the cluster's, its model the workload's "
                                      "or the one --model / --model-config names."),
        model: str | None = model_option(help_text="Model preset instead of the workload's (its "
                                                   "analytic cost model on the cluster's hardware, or "
                                                   "--cost-model fitted for it)."),
        model_config: Path | None = model_config_option(),
        loss_chunk_tokens: int | None = loss_chunk_option(),
        expert_parallel: int = typer.Option(
            1, "--expert-parallel", help="Ranks a mixture-of-experts model's experts are split over "
                                         "(contiguous; the planner charges the token all-to-alls of every "
                                         "MoE layer and holds 1/N of the experts per rank; costed, not "
                                         "run by the executor). 1: every rank holds every expert."),
        steps: int = typer.Option(5, "--steps", "-k", min=1, help="Steps to plan."),
        seed: int = typer.Option(0, "--seed", "-s", help="Sampler and planner seed."),
        batch_size: int = typer.Option(256, "--batch-size", "-b", min=1,
                                       help="Samples per global batch (at most 16,384, the service's limit)."),
        budget_ms: float = typer.Option(50.0, "--budget-ms", min=1.0,
                                        help="Planner budget per step (work limits scale)."),
        layout: str = typer.Option(
            "auto", "--layout", help="Attention layouts groups may run: auto (per group: Ulysses, a ring, "
                                     "or Ulysses in a node x ring; never predicted slower than ulysses), "
                                     "ulysses (sizes the heads allow), ring (every group of 2+ ranks a ring)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    ) -> None:
        """Plan K sampled batches; per step and in total: predicted step time of the plan and
        each baseline, speedups, gap to the lower bound, solver status and latency."""
        from costmodel.schema import CostModelFile
        from planner.limits import check_batch_size

        model_spec = resolve_model(model, model_config)
        if layout not in LAYOUT_CHOICES:
            raise typer.BadParameter(f"--layout {layout!r} is not one of {list(LAYOUT_CHOICES)}")
        try:
            check_batch_size(batch_size, name="--batch-size")
            file = None
            if cost_model is not None:
                try:
                    file = CostModelFile.load(cost_model)
                except (OSError, ValueError) as exc:
                    raise ValueError(f"--cost-model {cost_model}: {exc}") from None
            with progress_bar(f"planning {steps} steps", quiet=quiet, total=steps) as update:
                rows = plan_rows(workload=workload, cluster=cluster, steps=steps, seed=seed,
                                 batch_size=batch_size, budget_s=budget_ms / 1000.0, progress=update,
                                 cost_model_file=file, model=model_spec, layout=layout,
                                 loss_chunk_tokens=loss_chunk_tokens, expert_parallel_size=expert_parallel)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        summary = totals(rows)
        if as_json:
            typer.echo(json.dumps({"workload": workload, "cluster": cluster, "seed": seed, "layout": layout,
                                   "steps": rows, "total": summary}, indent=1))
            return
        print_plan_tables(rows, summary, title=f"dcp plan: {workload} on {cluster}, "
                                               f"{batch_size} samples per step")


def _bound_kinds(summary: dict[str, Any]) -> str:
    """``partition-lp in 4 and deadline-area in 1 of 5 steps``: which bounds the gaps are against."""
    kinds = [f"{k} in {n}" for k, n in summary["bound_kinds"].items()]
    if len(kinds) == 1:
        return f"{next(iter(summary['bound_kinds']))} in every step"
    return ", ".join(kinds[:-1]) + f" and {kinds[-1]} of {summary['steps']} steps"


BASELINES: dict[str, str] = {
    "bucket-sp1": "bucket parallel (DCP's baseline) at SP 1: shape buckets, largest batch",
    "bucket-sp2": "bucket parallel at SP 2",
    "bucket-sp4": "bucket parallel at SP 4, full recompute, as published with DCP",
    "bucket-sp8": "bucket parallel at SP 8",
    "static-best": "best fixed SP size, LPT-balanced, packed, cheapest fitting policy",
    "megatron-dyncp": "Megatron-Core dynamic CP: pow2 size per length, longest first",
    "dcp-greedy": "DCP's scheduler: random group fill, accumulation counts to a target",
    "ring-cp": "Megatron-Core ring CP, one size for the run (longest sample fits)",
    "usp": "USP hybrid, one size: Ulysses in a node x ring across nodes",
    "naive": "SP 1, samples dealt round-robin (sensitivity only)",
    "strongest": "the fastest baseline of each step, naive excepted (the headline)",
}
"""What each baseline of ``plan.baselines_s`` is (``planner/baselines/``), and the strongest."""


def _groups(sizes: list[int], layouts: list[list[int]] | None = None,
            ring_savings: list[list[Any]] | None = None) -> str:
    """``8x2 4`` for two groups of 8 and one of 4; a Ulysses x ring group shows ``[u*r]``, and the
    most a ring group saves against pure Ulysses of its size follows (``saves 1.23 s``)."""
    counts: dict[str, int] = {}
    for d, u, r in layouts if layouts is not None else [[d, d, 1] for d in sizes]:
        key = str(d) if r == 1 else f"{d}[{u}*{r}]"
        counts[key] = counts.get(key, 0) + 1
    text = " ".join(f"{k}x{c}" if c > 1 else k for k, c in counts.items())
    saved = [s for *_, s in ring_savings or [] if s is not None]
    return f"{text} (saves {fmt_s(max(saved))} s)" if saved else text


def baseline_order(baselines_s: dict[str, float]) -> list[str]:
    """Baseline names as the tables show them: ``strongest`` (the headline) first, ``bucket-sp4``
    (the DCP paper's comparison) second, then the others from fastest to slowest."""
    lead = [n for n in ("strongest", "bucket-sp4") if n in baselines_s]
    return lead + sorted((n for n in baselines_s if n not in lead), key=lambda n: (baselines_s[n], n))


def print_plan_tables(rows: list[dict[str, Any]], summary: dict[str, Any], *, title: str) -> None:
    """The steps table and the baselines table (each within 80 columns), with legends."""
    out = console()
    steps = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("step", "plan s", "gap", "bound", "status", "ms", "groups"):
        steps.add_column(col, justify="left" if col in ("bound", "status", "groups") else "right",
                         no_wrap=col != "groups")
    for r in rows:
        steps.add_row(str(r["step"]), fmt_s(r["step_time_s"]), fmt_pct(r["gap"]),
                      r["bound_kind"], r["status"], f"{r['latency_s'] * 1e3:.1f}",
                      _groups(r["group_sizes"], r.get("layouts"), r.get("ring_savings_s")))
    steps.add_row("all", fmt_s(summary["step_time_s"]), fmt_pct(summary["gap_mean"]), "mean", "",
                  f"{summary['latency_mean_s'] * 1e3:.1f}", "", style="bold")
    print_table(steps, [
        ("step", "step index (each step is a fresh batch drawn from the workload)"),
        ("plan s", "the plan's predicted step time, seconds (all: sum over steps)"),
        ("gap", "plan s / lower bound - 1: how far the plan may be from the best possible "
                f"(all: mean over steps, against {_bound_kinds(summary)}; --json has the bound in seconds)"),
        ("bound", "the tightest lower bound: longest, area, deadline-area, largest-choice (simple bounds), "
                  "partition-lp (an LP relaxation, planner/bounds/lp.py; at the default budget over at most "
                  "64 merged sample shapes), patterns (whole samples per group: a configuration LP, "
                  "planner/bounds/patterns.py; batches of at most 32), cpsat (CP-SAT's bound), "
                  "cpsat-optimal (CP-SAT proved it)"),
        ("status", "where the plan came from: OPTIMAL, FEASIBLE or HEURISTIC (the search), BASELINE "
                   "(a baseline was best) or POLISHED_BASELINE (a baseline improved by the search)"),
        ("ms", "planning time, milliseconds (all: mean)"),
        ("groups", "SP group sizes, DxCOUNT (8x2 = two groups of 8 GPUs); 64[8*8]: Ulysses over 8 x ring of 8; "
                   "saves: the most a ring group saves against pure Ulysses of its size (--json: per group)"),
    ], out=out)
    names = baseline_order(summary["baselines_s"])
    base = Table(title="Speedup over each baseline", box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("baseline", "steps", "total s", "speedup", "min", "max"):
        base.add_column(col, justify="left" if col == "baseline" else "right")
    for n in names:
        per_step = [r["speedups"][n] for r in rows if n in r["speedups"]]
        base.add_row(n, f"{summary['baseline_steps'][n]} of {summary['steps']}", fmt_s(summary["baselines_s"][n]),
                     fmt_x(summary["speedups"][n]), fmt_x(min(per_step)), fmt_x(max(per_step)))
    print_table(base, [
        ("baseline", "see below"),
        ("steps", "the steps the baseline could plan (one that cannot hold a batch's longest sample has "
                  "no time for that step); every figure of the row is over those steps"),
        ("total s", "the baseline's predicted time over its steps, seconds"),
        ("speedup", "total s / the plans' time over the same steps: the throughput gain of the plans"),
        ("min, max", "the lowest and highest per-step speedup"),
        *[(n, BASELINES.get(n, "")) for n in names],
    ], out=out)
