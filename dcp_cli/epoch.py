"""``dcp epoch``: precompute an epoch's plans offline into a SQLite store the service can serve."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dcp_cli.progress import make_progress
from dcp_cli.style import fail, fmt_pct, fmt_x

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from api.ray_runner import RayStepExecutor


def register(app: typer.Typer) -> None:
    """Add ``dcp epoch`` to the app."""

    @app.command("epoch")
    def epoch(
        manifest: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="MANIFEST",
                                        help="JSON Lines manifest (make one with dcp manifest)."),
        cluster: str = typer.Option("h200x8", help="Cluster preset."),
        cost_model: str = typer.Option("analytic-llama-7b-h200-sxm",
                                       help="Cost-model id: embedded (dcp presets) or stored in --out."),
        cost_model_file: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                                    help="A cost-model JSON file instead of an id."),
        out: Path = typer.Option(Path("plans.sqlite"), help="SQLite store (created or resumed)."),
        epoch_id: str | None = typer.Option(None, help="Epoch id (default <manifest stem>-s<seed>)."),
        samples_per_step: int | None = typer.Option(None, min=1, help="Global batch: samples per step."),
        tokens_per_step: int | None = typer.Option(None, min=1, help="Global batch: token budget per step."),
        seed: int = typer.Option(0, help="Shuffle seed; step seeds derive from it."),
        time_limit_s: float = typer.Option(
            2.0, help="Wall-clock safety cap per step (the search budget is deterministic)."),
        workers: int = typer.Option(os.cpu_count() or 1, help="Solver processes (ignored with --ray-address)."),
        ray_address: str | None = typer.Option(
            None, help="Plan the steps as Ray tasks on this cluster: auto, host:port (its GCS), "
                       "ray://host:port (Ray Client) or local (needs dcp-planner[ray])."),
        ray_steps_per_task: int = typer.Option(4, min=1, help="Steps planned by one Ray task."),
        max_steps: int | None = typer.Option(None, help="Stop after this many new steps (resumable)."),
        option: list[str] = typer.Option([], "--option", "-o",
                                         help="A PlannerConfig field as KEY=JSON (repeatable)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or log lines."),
    ) -> None:
        """Plan every step of an epoch (resumes an interrupted run of the same inputs)."""
        from api.jobs import prepare_epoch, run_epoch_job, same_request
        from api.pool import make_executor
        from api.registry import CostModelRegistry, resolve_cluster
        from api.store import PlanStore
        from costmodel.presets import builtin_cost_model_files
        from costmodel.schema import CostModelFile
        from planner.epoch import BatchRule
        from planner.workload import read_manifest

        if quiet:
            logging.getLogger().setLevel(logging.WARNING)
        # Every input is checked before the store is opened (or created).
        if (samples_per_step is None) == (tokens_per_step is None):
            fail("give the global batch rule: one of --samples-per-step N or --tokens-per-step N")
        rule = BatchRule(samples_per_step=samples_per_step, tokens_per_step=tokens_per_step)
        try:
            spec = resolve_cluster(cluster)
        except ValueError as exc:
            fail(f"--cluster: {exc}")
        try:
            samples = read_manifest(manifest)
        except ValueError as exc:
            fail(f"MANIFEST {exc}")
        if not samples:
            fail(f"MANIFEST {manifest} holds no samples")
        options: dict[str, Any] = {"time_limit_s": time_limit_s}
        for item in option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                fail(f"--option {item!r} is not KEY=VALUE")
            try:
                options[key] = json.loads(value)
            except json.JSONDecodeError:
                options[key] = value
        model: CostModelFile | None = None
        if cost_model_file is not None:
            try:
                model = CostModelFile.load(cost_model_file)
            except ValueError as exc:
                fail(f"--cost-model-file {cost_model_file}: {exc}")
        else:
            embedded = sorted(f.id for f in builtin_cost_model_files())
            if cost_model not in embedded and not out.exists():
                fail(f"--cost-model {cost_model!r} is not an embedded cost model (embedded: "
                     f"{', '.join(embedded)}); for a fitted or uploaded one pass --cost-model-file")
        # The cluster is reached before the store is opened: an unreachable one creates nothing.
        ray_executor = _ray_executor(ray_address, steps_per_task=ray_steps_per_task) if ray_address else None
        store = PlanStore.open(out)
        registry = CostModelRegistry(store)
        try:
            if model is not None:
                registry.add(model)
            else:
                model = registry.get(cost_model)
        except KeyError:
            store.close()
            fail(f"--cost-model {cost_model!r} is neither embedded nor stored in {out}; "
                 "pass --cost-model-file")
        except ValueError as exc:
            store.close()
            fail(f"--cost-model-file {cost_model_file}: {exc}")
        eid = epoch_id or f"{manifest.stem}-s{seed}"
        record = store.get_epoch(eid)
        if record is None:
            try:
                record = prepare_epoch(store, epoch_id=eid, samples=samples, rule=rule, seed=seed,
                                       cluster=spec, cost_model=model, options=options,
                                       manifest_source=str(manifest))
            except ValueError as exc:
                store.close()
                fail(str(exc))
        elif not same_request(record, rule=rule, seed=seed, cluster=spec, cost_model=model,
                              options=options, samples=samples):
            store.close()
            fail(f"--epoch-id {eid!r} in {out} was made from other inputs; pass another --epoch-id or --out")
        elif record.state == "done":
            store.close()
            typer.echo(f"epoch {eid}: all {record.steps_total} steps already stored in {out}")
            return
        executor: Executor
        if ray_executor is not None:
            executor, workers = ray_executor, ray_executor.num_slots()
            runner = f"ray {ray_executor.num_cpus()} CPU(s)"
        else:
            executor, runner = make_executor(workers), f"{workers} process(es)"
        new_steps = 0
        started = time.monotonic()
        with make_progress(quiet=quiet) as progress:
            bar = progress.add_task(f"epoch {eid} ({runner})", total=record.steps_total,
                                    completed=record.steps_done)

            def on_written(n: int) -> None:
                nonlocal new_steps
                new_steps += n
                rate = new_steps / max(time.monotonic() - started, 1e-9)
                progress.update(bar, advance=n, description=f"epoch {eid} ({runner}) {rate:.1f} steps/s")

            try:
                final = run_epoch_job(
                    store, eid, get_cost_model=registry.get, executor=executor, num_workers=workers,
                    stop_state=lambda: "queued", on_written=on_written, max_steps=max_steps)
            finally:
                executor.shutdown(wait=True, cancel_futures=True)
        elapsed_s = time.monotonic() - started
        logging.getLogger(__name__).info("epoch %s: %d new step(s) in %.1f s (%.2f steps/s, %s)", eid,
                                         new_steps, elapsed_s, new_steps / max(elapsed_s, 1e-9), runner)
        summary = store.summary(eid)
        store.close()
        gap, speedup = summary["mean_gap"], summary["mean_speedup_vs_bucket"]
        typer.echo(f"epoch {final.id}: {final.state}, {final.steps_done}/{final.steps_total} steps in {out}"
                   + (f"; mean gap to the lower bound {fmt_pct(gap)}" if gap is not None else "")
                   + (f", mean predicted speedup over bucket parallel {fmt_x(speedup)}"
                      if speedup is not None else ""))
        if final.state == "failed":
            typer.echo(f"error: {final.error}", err=True)
            raise typer.Exit(1)


def _ray_executor(address: str, *, steps_per_task: int) -> RayStepExecutor:
    """A connected Ray executor; exits with a clear message when Ray is missing or the cluster
    cannot be reached."""
    from api.faults import ClusterUnavailableError
    from api.ray_runner import RayConfig, RayNotInstalledError, connect_executor

    try:
        return connect_executor(RayConfig(address=address, steps_per_task=steps_per_task))
    except (ValueError, RayNotInstalledError, ClusterUnavailableError) as exc:
        fail(f"--ray-address: {exc}")
