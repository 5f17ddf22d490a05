"""``dcp epoch``: precompute an epoch's plans offline into a SQLite store the service can serve."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from dcp_cli.model_option import loss_chunk_option, model_config_option, model_option
from dcp_cli.plan import LAYOUT_CHOICES
from dcp_cli.progress import make_progress
from dcp_cli.style import fail, fmt_pct, fmt_x, require_parent

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from api.ray_runner import RayStepExecutor
    from api.store import PlanStore
    from costmodel.schema import CostModelFile
    from costmodel.specs import HardwareSpec, Sample

DEFAULT_TEXT_MODEL = "llama-7b"
"""The model preset a text manifest is planned under when no model is named."""


def epoch_table(command: Any, ctx: typer.Context, path: Path) -> dict[str, Any]:
    """The ``[epoch]`` table of a config file as defaults of ``command`` (``dcp epoch``), each
    value checked as its option would check it on the command line.

    Raises:
        ValueError: naming the file and the key: an unknown option, or a value of the wrong type.
    """
    from api.config_file import EPOCH_TABLE, epoch_defaults

    params = {p.name: p for p in command.params if p.name and p.name not in ("config", "manifest")}
    defaults = epoch_defaults(path, known=set(params))
    for key, value in defaults.items():
        try:
            params[key].process_value(ctx, value)
        except typer.BadParameter as exc:
            raise ValueError(f"config file {path}: [{EPOCH_TABLE}] {key.replace('_', '-')} = {value!r}: "
                             f"{exc.message}") from None
    return defaults


def _apply_config(ctx: typer.Context, value: Path | None) -> Path | None:
    """``--config FILE``: its ``[epoch]`` table becomes the defaults of the other options
    (``api.config_file``); flags given on the command line still win."""
    if value is None:
        return None
    try:
        defaults = epoch_table(ctx.command, ctx, value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def register(app: typer.Typer) -> None:
    """Add ``dcp epoch`` to the app."""

    @app.command("epoch")
    def epoch(
        manifest: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="MANIFEST",
                                        help="JSON Lines manifest (make one with dcp manifest)."),
        cluster: str = typer.Option("h200x8", help="Cluster preset."),
        model: str | None = model_option(help_text="Model preset: plans under its analytic cost model on the "
                                                   "cluster's hardware (default for a text manifest: "
                                                   f"{DEFAULT_TEXT_MODEL}; a video manifest needs a model)."),
        model_config: Path | None = model_config_option(),
        loss_chunk_tokens: int | None = loss_chunk_option(),
        cost_model: str | None = typer.Option(None, help="Cost-model id instead of a model: embedded "
                                                         "(dcp presets) or stored in --out."),
        cost_model_file: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                                    help="A cost-model JSON file instead of an id."),
        out: Path = typer.Option(Path("plans.sqlite"), help="SQLite store (created or resumed)."),
        epoch_id: str | None = typer.Option(None, help="Epoch id (default <manifest stem>-s<seed>)."),
        samples_per_step: int | None = typer.Option(None, min=1, help="Global batch: samples per step."),
        tokens_per_step: int | None = typer.Option(None, min=1, help="Global batch: token budget per step."),
        seed: int = typer.Option(0, help="Shuffle seed; step seeds derive from it."),
        time_limit_s: float = typer.Option(
            2.0, help="Wall-clock safety cap per step (the search budget is deterministic)."),
        layout: str = typer.Option(
            "auto", help="Attention layouts groups may run: auto (per group: Ulysses, a ring, or Ulysses "
                         "in a node x ring; never predicted slower than ulysses), ulysses (sizes the heads "
                         "allow), ring (every group of 2+ "
                            "ranks a ring); the epoch declares them for the executors' process groups."),
        workers: int = typer.Option(os.cpu_count() or 1, help="Solver processes (ignored with --ray-address)."),
        ray_address: str | None = typer.Option(
            None, help="Plan the steps as Ray tasks on this cluster: auto, host:port (its GCS), "
                       "ray://host:port (Ray Client) or local (needs dcp-planner[ray])."),
        ray_steps_per_task: int = typer.Option(4, min=1, help="Steps planned by one Ray task."),
        max_steps: int | None = typer.Option(None, help="Stop after this many new steps (resumable)."),
        option: list[str] = typer.Option([], "--option", "-o",
                                         help="A PlannerConfig field as KEY=JSON (repeatable)."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or log lines."),
        config: Path | None = typer.Option(  # applied by its callback
            None, "--config", exists=True, dir_okay=False, is_eager=True, callback=_apply_config,
            help="TOML file whose [epoch] table gives defaults to these options (flags override it)."),
    ) -> None:
        """Plan every step of an epoch (resumes an interrupted run of the same inputs)."""
        from api.jobs import prepare_epoch, run_epoch_job, same_request
        from api.pool import make_executor
        from api.registry import CostModelRegistry, resolve_cluster
        from api.store import PlanStore
        from costmodel.presets import builtin_cost_model_files
        from costmodel.schema import CostModelFile
        from planner.epoch import BatchRule, build_config
        from planner.fit_check import check_samples_fit
        from planner.limits import MAX_MANIFEST_SAMPLES, MAX_SAMPLES_PER_REQUEST
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
        _check_out(out)
        if samples_per_step is not None and samples_per_step > MAX_SAMPLES_PER_REQUEST:
            fail(f"--samples-per-step {samples_per_step:,} is over the service's limit of "
                 f"{MAX_SAMPLES_PER_REQUEST:,} samples for one batch")
        try:
            samples = read_manifest(manifest)
        except ValueError as exc:
            fail(f"MANIFEST {exc}")
        if not samples:
            fail(f"MANIFEST {manifest} holds no samples")
        if len(samples) > MAX_MANIFEST_SAMPLES:
            fail(f"MANIFEST {manifest} holds {len(samples):,} samples, over the service's limit of "
                 f"{MAX_MANIFEST_SAMPLES:,} for one manifest")
        if layout not in LAYOUT_CHOICES:
            fail(f"--layout {layout!r} is not one of {list(LAYOUT_CHOICES)}")
        # the layout always stored: a job stored without one ran under the old default, ulysses
        options: dict[str, Any] = {"time_limit_s": time_limit_s, "layout": layout}
        for item in option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                fail(f"--option {item!r} is not KEY=VALUE")
            try:
                options[key] = json.loads(value)
            except json.JSONDecodeError:
                options[key] = value
        named = [name for name, value in (("--model", model), ("--model-config", model_config),
                                          ("--cost-model", cost_model), ("--cost-model-file", cost_model_file))
                 if value is not None]
        if len(named) > 1:
            fail(f"give one of --model, --model-config, --cost-model and --cost-model-file, not {' and '.join(named)}")
        if loss_chunk_tokens is not None and (cost_model is not None or cost_model_file is not None):
            fail(f"--loss-chunk-tokens {loss_chunk_tokens} applies to the analytic cost model of a model "
                 "(--model, --model-config or the text default); a cost-model file charges the loss as it "
                 "was profiled")
        derived, model_source = _derived_cost_model(model, model_config, named=bool(named), samples=samples,
                                                    manifest=manifest, hardware=spec.hardware,
                                                    loss_chunk_tokens=loss_chunk_tokens)
        file: CostModelFile | None = derived
        if cost_model_file is not None:
            try:
                file = CostModelFile.load(cost_model_file)
            except ValueError as exc:
                fail(f"--cost-model-file {cost_model_file}: {exc}")
        elif cost_model is not None:
            embedded = {f.id: f for f in builtin_cost_model_files()}
            if cost_model not in embedded and not out.exists():
                fail(f"--cost-model {cost_model!r} is not an embedded cost model (embedded: "
                     f"{', '.join(sorted(embedded))}); for a fitted or uploaded one pass --cost-model-file")
            file = embedded.get(cost_model)
        try:
            planner_config = build_config(options)
        except ValueError as exc:
            fail(f"--option: {exc}")
        if file is not None:
            _check_kind(samples, file, manifest)
            try:  # a sample that fits nowhere stops here, not at its step after the store exists
                check_samples_fit(samples, cluster=spec, cost_model=file, config=planner_config)
            except ValueError as exc:
                fail(f"MANIFEST {manifest}: {exc}")
        if ray_address:  # a lost local raylet ends the driver from C++: a parent records it
            from dcp_cli.ray_supervisor import supervise

            supervise(out=out, epoch_id=epoch_id or f"{manifest.stem}-s{seed}")
        # The cluster is reached before the store is opened: an unreachable one creates nothing.
        ray_executor = _ray_executor(ray_address, steps_per_task=ray_steps_per_task) if ray_address else None
        created = not out.exists()
        try:
            store = PlanStore.open(out)
        except sqlite3.DatabaseError as exc:
            fail(f"--out {out} is not a usable SQLite store ({exc})")

        def refuse(message: str) -> NoReturn:
            """Close the store, remove it when this run created it (no empty store is left behind),
            and exit 2 with ``message``."""
            store.close()
            if created:
                for path in (out, out.with_name(out.name + "-wal"), out.with_name(out.name + "-shm")):
                    path.unlink(missing_ok=True)
            fail(message)

        registry = CostModelRegistry(store)
        try:
            if derived is not None:
                file = registry.add_derived(derived)
            elif cost_model_file is not None and file is not None:
                registry.add(file)
            else:
                assert cost_model is not None
                file = registry.get(cost_model)
                _check_kind(samples, file, manifest, store=store)
        except KeyError:
            refuse(f"--cost-model {cost_model!r} is neither embedded nor stored in {out}; "
                   "pass --cost-model-file")
        except ValueError as exc:
            refuse(f"--cost-model-file {cost_model_file}: {exc}")
        model_file: CostModelFile = file
        eid = epoch_id or f"{manifest.stem}-s{seed}"
        record = store.get_epoch(eid)
        if record is None:
            try:
                record = prepare_epoch(store, epoch_id=eid, samples=samples, rule=rule, seed=seed,
                                       cluster=spec, cost_model=model_file, options=options,
                                       manifest_source=str(manifest), model_source=model_source)
            except ValueError as exc:
                refuse(str(exc))
        elif not same_request(record, rule=rule, seed=seed, cluster=spec, cost_model=model_file,
                              options=options, samples=samples):
            refuse(f"--epoch-id {eid!r} in {out} was made from other inputs; pass another --epoch-id or --out")
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
        try:
            with make_progress(quiet=quiet) as progress:
                # Shown from the start: the first steps wait for the workers to start and import.
                bar = progress.add_task(f"epoch {eid} ({runner}): starting the workers", total=record.steps_total,
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
        except KeyboardInterrupt:  # Ctrl-C: the finished steps are stored; say so and how to go on
            stopped = store.get_epoch(eid)
            store.close()
            done = f"{stopped.steps_done}/{stopped.steps_total} steps" if stopped is not None else "the finished steps"
            typer.echo(f"interrupted: epoch {eid} stopped with {done} stored in {out}; run the same command "
                       "again to resume from them", err=True)
            raise typer.Exit(130) from None
        elapsed_s = time.monotonic() - started
        logging.getLogger(__name__).info("epoch %s: %d new step(s) in %.1f s (%.2f steps/s, %s)", eid,
                                         new_steps, elapsed_s, new_steps / max(elapsed_s, 1e-9), runner)
        if final.state == "failed" and final.transient and ray_address:
            # The Ray cluster failed mid-job and the driver lived to say so: record it as the
            # supervisor records an abrupt end (queued, "interrupted: ..."), resumable by a rerun.
            from api.jobs import record_state

            final_error = f"interrupted: {final.error}"
            if record_state(store, eid, "queued", error=final_error, transient=True):
                final = store.get_epoch(eid) or final
        summary = store.summary(eid)
        store.close()
        gap, strong, bucket = (summary["mean_gap"], summary["mean_speedup_vs_strongest"],
                               summary["mean_speedup_vs_bucket"])
        typer.echo(f"epoch {final.id}: {final.state}, {final.steps_done}/{final.steps_total} steps in {out}"
                   + (f"; mean gap to the lower bound {fmt_pct(gap)}" if gap is not None else "")
                   + (f", mean predicted speedup over the strongest baseline {fmt_x(strong)} in "
                      f"{summary['steps_vs_strongest']} of {final.steps_done} steps" if strong is not None else "")
                   + (f" (over bucket-sp4, the DCP paper's baseline: {fmt_x(bucket)} in "
                      f"{summary['steps_vs_bucket']} of {final.steps_done} steps)" if bucket is not None else ""))
        if final.state == "failed" or (final.state == "queued" and (final.error or "").startswith("interrupted")):
            # A passing fault (a lost Ray node, a busy store): the stored steps are kept and the same
            # command resumes from them; say so, as the abrupt-exit path does (ray_supervisor).
            resume = ("; run the same command again to resume from the stored steps"
                      if final.transient else "")
            typer.echo(f"error: {final.error}{resume}", err=True)
            raise typer.Exit(1)


def _derived_cost_model(model: str | None, model_config: Path | None, *, named: bool, samples: list[Sample],
                        manifest: Path, hardware: HardwareSpec, loss_chunk_tokens: int | None = None
                        ) -> tuple[CostModelFile | None, str | None]:
    """The analytic cost model of ``--model`` / ``--model-config`` on the cluster's hardware, or
    of the text default when nothing is named and the manifest is text, with where it came from;
    ``loss_chunk_tokens`` (``--loss-chunk-tokens``) sets its LM loss chunk, at most the manifest's
    longest sample.

    A video manifest with nothing named is refused: video samples fit 2d and 3d models alike,
    so the planner does not guess (a text manifest keeps its old default, said in the log)."""
    from costmodel.analytic import analytic_cost_model
    from costmodel.model_choice import select_model, with_loss_chunk
    from costmodel.presets import load_model, model_names

    try:
        chosen = select_model(model=model, model_config=model_config)
    except ValueError as exc:
        fail(str(exc))
    if chosen is None and named:
        return None, None
    if chosen is None:
        video = next((s for s in samples if s.is_2d), None)
        if video is not None:
            kinds = {n: load_model(n).kind for n in model_names()}
            presets = ", ".join(f"{n} ({k})" for n, k in kinds.items() if k != "1d")
            fail(f"MANIFEST {manifest} holds video samples (first: {video.id!r}) and no model is named: "
                 f"pass --model ({presets}) or --model-config; only a text manifest defaults to "
                 f"{DEFAULT_TEXT_MODEL}")
        chosen = load_model(DEFAULT_TEXT_MODEL)
        logging.getLogger(__name__).info(
            "no model named: planning the text manifest %s under the default model %s "
            "(--model or --model-config names another)", manifest, DEFAULT_TEXT_MODEL)
        source = f"model {DEFAULT_TEXT_MODEL} (default for a text manifest)"
    else:
        source = f"model {model}" if model is not None else f"model_config {model_config}"
    try:
        chosen = with_loss_chunk(chosen, loss_chunk_tokens, max_sample_tokens=max(s.tokens for s in samples),
                                 option="--loss-chunk-tokens")
    except ValueError as exc:
        fail(str(exc))
    return analytic_cost_model(chosen, hardware), source


_SQLITE_HEADER = b"SQLite format 3\x00"


def _check_out(out: Path) -> None:
    """Stop (exit 2) when ``--out`` names a directory or a file that is not a SQLite database
    (an empty file is fine: SQLite makes it a new store)."""
    if out.is_dir():
        fail(f"--out {out} is a directory; give a SQLite file (created when absent)")
    require_parent(out, option="--out")
    if out.exists():
        try:
            with out.open("rb") as fh:
                head = fh.read(len(_SQLITE_HEADER))
        except OSError as exc:
            fail(f"--out {out} cannot be read ({exc.strerror})")
        if head and head != _SQLITE_HEADER:
            fail(f"--out {out} is not a SQLite file; give a new path or a store dcp epoch or "
                 "dcp serve made")


def _check_kind(samples: list[Sample], file: CostModelFile, manifest: Path, *, store: PlanStore | None = None
                ) -> None:
    """Stop (exit 2, closing the store) when the manifest's kind is not the model's."""
    from costmodel.model_choice import check_samples_kind

    try:
        check_samples_kind(samples, file.model, source=f"MANIFEST {manifest}")
    except ValueError as exc:
        if store is not None:
            store.close()
        fail(str(exc))


def _ray_executor(address: str, *, steps_per_task: int) -> RayStepExecutor:
    """A connected Ray executor; exits with a clear message when Ray is missing or the cluster
    cannot be reached."""
    from api.faults import ClusterUnavailableError
    from api.ray_runner import RayConfig, RayNotInstalledError, connect_executor

    try:
        return connect_executor(RayConfig(address=address, steps_per_task=steps_per_task))
    except (ValueError, RayNotInstalledError, ClusterUnavailableError) as exc:
        fail(f"--ray-address: {exc}")
