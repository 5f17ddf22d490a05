"""``dcp plan``: plan sampled batches of a workload preset and compare with the baselines."""

from __future__ import annotations

import json
import time
from typing import Any

import typer
from rich.console import Console
from rich.table import Table


def plan_rows(*, workload: str, cluster: str, steps: int, seed: int, batch_size: int,
              budget_s: float) -> list[dict[str, Any]]:
    """One row per step: the plan's and every baseline's predicted step time, gap, latency."""
    from costmodel.presets import default_cost_model_file, load_cluster
    from planner.config import PlannerConfig
    from planner.planning import plan_batch
    from planner.workload import WorkloadSpec, sample_batch

    spec = WorkloadSpec.preset(workload)
    cluster_spec = load_cluster(cluster)
    cost_model = default_cost_model_file(spec.model, cluster_spec.hardware.name)
    config = PlannerConfig.for_budget(budget_s, seed=seed)
    rows = []
    for step in range(steps):
        samples = sample_batch(spec, num_samples=batch_size, seed=seed, step=step)
        start = time.perf_counter()
        plan = plan_batch(samples, cluster=cluster_spec, cost_model=cost_model, config=config,
                          step=step, reference_sample=spec.max_sample)
        latency = time.perf_counter() - start
        rows.append({
            "step": step,
            "num_samples": len(samples),
            "step_time_s": plan.predicted_step_time_s,
            "baselines_s": plan.baselines_s,
            "speedups": {k: v / plan.predicted_step_time_s for k, v in plan.baselines_s.items()},
            "lower_bound_s": plan.lower_bound.value_s,
            "bound_kind": plan.lower_bound.kind,
            "gap": plan.gap,
            "status": plan.solver.status,
            "method": plan.solver.method,
            "latency_s": latency,
            "group_sizes": sorted((g.size for g in plan.groups), reverse=True),
            "digest": plan.content_digest(),
        })
    return rows


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whole-run figures: total time of the plans and of each baseline, throughput speedups."""
    plan_total = sum(r["step_time_s"] for r in rows)
    names = sorted({k for r in rows for k in r["baselines_s"]})
    base = {k: sum(r["baselines_s"][k] for r in rows if k in r["baselines_s"]) for k in names}
    return {
        "steps": len(rows),
        "step_time_s": plan_total,
        "baselines_s": base,
        "speedups": {k: v / plan_total for k, v in base.items()},
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
        cluster: str = typer.Option(..., "--cluster", "-c", help="Cluster preset."),
        steps: int = typer.Option(5, "--steps", "-k", min=1, help="Steps to plan."),
        seed: int = typer.Option(0, "--seed", "-s", help="Sampler and planner seed."),
        batch_size: int = typer.Option(256, "--batch-size", "-b", min=1,
                                       help="Samples per global batch."),
        budget_ms: float = typer.Option(50.0, "--budget-ms", min=1.0,
                                        help="Planner budget per step (work limits scale)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Plan K sampled batches; per step and in total: predicted step time of the plan and
        each baseline, speedups, gap to the lower bound, solver status and latency."""
        try:
            rows = plan_rows(workload=workload, cluster=cluster, steps=steps, seed=seed,
                             batch_size=batch_size, budget_s=budget_ms / 1000.0)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        summary = totals(rows)
        if as_json:
            typer.echo(json.dumps({"workload": workload, "cluster": cluster, "seed": seed,
                                   "steps": rows, "total": summary}, indent=1))
            return
        names = sorted(summary["baselines_s"])
        table = Table(title=f"dcp plan: {workload} on {cluster}, {batch_size} samples per step")
        for col in ["step", "plan s", *[f"x{n}" for n in names], "gap", "bound", "status",
                    "ms", "groups"]:
            table.add_column(col, justify="right" if col not in ("bound", "status") else "left")
        for r in rows:
            counts: dict[int, int] = {}
            for d in r["group_sizes"]:
                counts[d] = counts.get(d, 0) + 1
            shown = " ".join(f"{d}x{c}" if c > 1 else str(d) for d, c in counts.items())
            table.add_row(str(r["step"]), f"{r['step_time_s']:.4f}",
                          *[f"{r['speedups'][n]:.2f}" if n in r["speedups"] else "-"
                            for n in names],
                          f"{r['gap']:.2%}", r["bound_kind"], r["status"],
                          f"{r['latency_s'] * 1e3:.1f}", shown)
        table.add_row("total", f"{summary['step_time_s']:.4f}",
                      *[f"{summary['speedups'][n]:.2f}" for n in names],
                      f"{summary['gap_mean']:.2%}", "mean", "",
                      f"{summary['latency_mean_s'] * 1e3:.1f}", "", style="bold")
        console = Console()
        console.width = max(console.width, 150)  # the table is wide; let it wrap, not squeeze
        console.print(table)
