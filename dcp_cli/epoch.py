"""``dcp epoch``: precompute an epoch's plans offline into a SQLite store the service can serve."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    """Add ``dcp epoch`` to the app."""

    @app.command("epoch")
    def epoch(
        manifest: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSON Lines manifest."),
        cluster: str = typer.Option("h200x8", help="Cluster preset."),
        cost_model: str = typer.Option("analytic-llama-7b-h200-sxm", help="Cost-model id (embedded)."),
        cost_model_file: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                                    help="A cost-model JSON file instead of an id."),
        out: Path = typer.Option(Path("plans.sqlite"), help="SQLite store (created or resumed)."),
        epoch_id: str | None = typer.Option(None, help="Epoch id (default <manifest stem>-s<seed>)."),
        samples_per_step: int | None = typer.Option(None, help="Global batch: samples per step."),
        tokens_per_step: int | None = typer.Option(None, help="Global batch: token budget per step."),
        seed: int = typer.Option(0, help="Shuffle seed; step seeds derive from it."),
        time_limit_s: float = typer.Option(
            2.0, help="Wall-clock safety cap per step (the search budget is deterministic)."),
        workers: int = typer.Option(os.cpu_count() or 1, help="Solver processes."),
        max_steps: int | None = typer.Option(None, help="Stop after this many new steps (resumable)."),
        option: list[str] = typer.Option([], "--option", "-o",
                                         help="A PlannerConfig field as KEY=JSON (repeatable)."),
    ) -> None:
        """Plan every step of an epoch (resumes an interrupted run of the same inputs)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from api.jobs import prepare_epoch, run_epoch_job, same_request
        from api.pool import make_executor
        from api.registry import CostModelRegistry, resolve_cluster
        from api.store import PlanStore
        from costmodel.schema import CostModelFile
        from planner.epoch import BatchRule
        from planner.workload import read_manifest

        try:
            rule = BatchRule(samples_per_step=samples_per_step, tokens_per_step=tokens_per_step)
            spec = resolve_cluster(cluster)
            samples = read_manifest(manifest)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        store = PlanStore.open(out)
        registry = CostModelRegistry(store)
        try:
            if cost_model_file is not None:
                model = CostModelFile.load(cost_model_file)
                registry.add(model)
            else:
                model = registry.get(cost_model)
        except (KeyError, ValueError) as exc:
            raise typer.BadParameter(str(exc.args[0] if isinstance(exc, KeyError) else exc)) from None
        options: dict[str, Any] = {"time_limit_s": time_limit_s}
        for item in option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise typer.BadParameter(f"--option {item!r} is not KEY=VALUE")
            try:
                options[key] = json.loads(value)
            except json.JSONDecodeError:
                options[key] = value
        eid = epoch_id or f"{manifest.stem}-s{seed}"
        record = store.get_epoch(eid)
        if record is None:
            try:
                record = prepare_epoch(store, epoch_id=eid, samples=samples, rule=rule, seed=seed,
                                       cluster=spec, cost_model=model, options=options,
                                       manifest_source=str(manifest))
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
        elif not same_request(record, rule=rule, seed=seed, cluster=spec, cost_model=model,
                              options=options, samples=samples):
            raise typer.BadParameter(f"epoch {eid!r} in {out} was made from other inputs; "
                                     "pass another --epoch-id or --out")
        elif record.state == "done":
            typer.echo(f"epoch {eid}: all {record.steps_total} steps already stored in {out}")
            return
        executor = make_executor(workers)
        new_steps = 0
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn()) as progress:
            bar = progress.add_task(f"epoch {eid}", total=record.steps_total,
                                    completed=record.steps_done)

            def on_written(n: int) -> None:
                nonlocal new_steps
                new_steps += n
                progress.advance(bar, n)

            try:
                final = run_epoch_job(
                    store, eid, get_cost_model=registry.get, executor=executor, num_workers=workers,
                    stop_state=lambda: "queued", on_written=on_written, max_steps=max_steps)
            finally:
                executor.shutdown(wait=True, cancel_futures=True)
        summary = store.summary(eid)
        store.close()
        typer.echo(f"epoch {final.id}: {final.state}, {final.steps_done}/{final.steps_total} steps "
                   f"in {out}; mean gap {summary['mean_gap']}, mean speedup vs bucket "
                   f"{summary['mean_speedup_vs_bucket']}")
        if final.state == "failed":
            typer.echo(f"error: {final.error}", err=True)
            raise typer.Exit(1)
