"""``dcp report plan`` and ``dcp report epoch``: pictures of a plan and of an epoch (PNG, SVG, HTML).

Run ``dcp report plan --workload video-short --cluster h200x32`` (files in ``dcp-report/``) for the
Gantt chart of one sampled step beside the strongest baseline's, ``dcp report plan dcp-report/plan.json``
for a stored plan, and ``dcp report epoch plans.sqlite --epoch e0`` for an epoch's speedup and
gap per step and its one-page HTML summary.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dcp_cli.style import fail, require_parent

if TYPE_CHECKING:
    from costmodel.evaluate import CostModel
    from planner.plan import Plan

logger = logging.getLogger(__name__)

app = typer.Typer(name="report", no_args_is_help=True,
                  help="Pictures: a plan's Gantt chart beside the strongest baseline's (PNG, SVG); an "
                       "epoch's speedup and gap per step and a one-page HTML summary.")

DEFAULT_OUT_DIR = Path("dcp-report")
"""Where pictures go by default: ``dcp-report/`` in the working directory (not ``report/``, which
from the repository root is the ``report`` source package)."""

_SOURCE_PACKAGES = ("api", "bench", "costmodel", "dcp_cli", "executor", "ingest", "planner", "report")


def _check_out_dir(out_dir: Path) -> Path:
    """``out_dir``, or exit 2 when it lies inside one of this project's source packages or its
    parent directory does not exist (``out_dir`` itself is created)."""
    import importlib.util

    require_parent(out_dir, option="--out-dir")

    target = out_dir.resolve()
    for name in _SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            if target.is_relative_to(Path(location).resolve()):
                fail(f"--out-dir {out_dir} is inside the source package {name!r} ({location}); "
                     f"give a directory outside the source tree (default {DEFAULT_OUT_DIR}/)")
    return out_dir


OUT_DIR = typer.Option(DEFAULT_OUT_DIR, "--out-dir", "-o", file_okay=False, callback=_check_out_dir,
                       help="Directory the files are written to (created; files in it replaced); "
                            "not inside a source package.")


def _write(out_dir: Path, name: str, data: bytes | str) -> Path:
    out_dir.mkdir(exist_ok=True)  # (its parent exists: _check_out_dir)
    path = out_dir / name
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def _read_plan(path: Path) -> Plan:
    """A plan JSON file: a ``Plan``, or the service's answer holding one under ``plan``."""
    from pydantic import ValidationError

    from planner.plan import Plan

    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(f"PLAN {path}: not a readable JSON file ({exc})")
    if isinstance(data, dict) and isinstance(data.get("plan"), dict):
        data = data["plan"]
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        fail(f"PLAN {path}: not a plan ({where}: {first.get('msg')}); give a plan JSON as POST "
             "/v1/plans or GET /v1/epochs/{id}/steps/{s} returns it")


def _memory_files(out_dir: Path, plan: Plan, cost_model: CostModel, *, label: str) -> list[Path]:
    """memory.png and memory.svg: each group's predicted peak per rank by part against the cap."""
    from planner.memory_view import plan_memory
    from report.memory import memory_image

    groups = plan_memory(plan, cost_model)
    title = (f"{label}: predicted peak memory per rank, {plan.num_ranks} GPUs ({plan.cluster_name}), "
             f"cost model {plan.cost_model_id}")
    hbm = cost_model.cluster.hardware.hbm_bytes
    return [_write(out_dir, f"memory.{fmt}", memory_image(groups, title=title, hbm_bytes=hbm, fmt=fmt))
            for fmt in ("png", "svg")]


@app.command("plan")
def report_plan(
    plan_file: Path | None = typer.Argument(None, exists=True, dir_okay=False, metavar="PLAN",
                                            help="A plan JSON file; without it a step of --workload "
                                                 "is planned now."),
    workload: str | None = typer.Option(None, "--workload", "-w", help="Workload preset to sample a step from."),
    cluster: str | None = typer.Option(None, "--cluster", "-c",
                                       help="Cluster preset (default for a PLAN: the one it names)."),
    step: int = typer.Option(0, "--step", "-k", min=0, help="Which sampled step of --workload."),
    seed: int = typer.Option(0, "--seed", "-s", help="Sampler and planner seed (--workload)."),
    batch_size: int = typer.Option(256, "--batch-size", "-b", min=1, help="Samples per global batch."),
    budget_ms: float = typer.Option(50.0, "--budget-ms", min=1.0, help="Planner budget (--workload)."),
    cost_model_file: Path | None = typer.Option(
        None, "--cost-model-file", exists=True, dir_okay=False,
        help="The plan's cost-model file when it is not an embedded one (dcp presets)."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                  help="Draw the strongest baseline's plan of the same batch below."),
    trace: Path | None = typer.Option(
        None, "--trace", dir_okay=False,
        help="Also write the plan as a Chrome trace-event JSON file here (Perfetto UI, chrome://tracing)."),
    out_dir: Path = OUT_DIR,
) -> None:
    """The Gantt chart of one plan (gantt.png, gantt.svg; plan.json for a planned step), its
    memory chart (memory.png, memory.svg: each group's predicted peak per rank by part) and both
    in plan.html with hover text on every micro-batch: every
    group's micro-batches over time, split into compute, recompute and all-to-all, idle and the
    gradient sync, above the same batch under the strongest baseline (fastest but naive). With
    ``--trace``, the same step as a trace file: one track per rank (report/trace.py)."""
    from costmodel.evaluate import CostModel
    from costmodel.presets import builtin_cost_model_files, default_cost_model_file, load_cluster
    from costmodel.schema import CostModelFile
    from planner.baseline_plan import strongest_baseline_plan
    from planner.config import PlannerConfig
    from report.figures import PlanPictureInput
    from report.plan_report import plan_image

    if (plan_file is None) == (workload is None):
        fail("give one of: a PLAN file, or --workload and --cluster to plan a step now")
    file: CostModelFile | None = None
    if cost_model_file is not None:
        try:
            file = CostModelFile.load(cost_model_file)
        except (OSError, ValueError) as exc:
            fail(f"--cost-model-file {cost_model_file}: {exc}")
    reference = None
    try:
        if plan_file is not None:
            plan = _read_plan(plan_file)
            try:
                cluster_spec = load_cluster(cluster or plan.cluster_name)
            except ValueError as exc:
                fail(f"--cluster: {exc}" if cluster else f"PLAN is for cluster {plan.cluster_name!r}, not a "
                     f"preset ({exc}); pass --cluster with a preset of the same world")
            if file is None:
                embedded = {f.id: f for f in builtin_cost_model_files()}
                if plan.cost_model_id not in embedded:
                    fail(f"PLAN was made with cost model {plan.cost_model_id!r}, not an embedded one: "
                         "pass its file with --cost-model-file")
                file = embedded[plan.cost_model_id]
            samples = [ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples]
            config = PlannerConfig(seed=plan.solver.seed)
            label = f"{plan_file.name}"
        else:
            from planner.planning import plan_batch
            from planner.workload import WorkloadSpec, sample_batch

            if cluster is None:
                fail("--workload needs --cluster")
            spec = WorkloadSpec.preset(workload or "")
            try:
                cluster_spec = load_cluster(cluster)
            except ValueError as exc:
                fail(f"--cluster: {exc}")
            if file is None:
                try:
                    file = default_cost_model_file(spec.model, cluster_spec.hardware.name)
                except ValueError as exc:
                    fail(f"--cluster {cluster}: no embedded cost model of {spec.model!r} on "
                         f"{cluster_spec.hardware.name!r} ({exc}); pass --cost-model-file (dcp fit)")
            samples = sample_batch(spec, num_samples=batch_size, seed=seed, step=step)
            config = PlannerConfig.for_budget(budget_ms / 1000.0, seed=seed)
            reference = spec.max_sample
            plan = plan_batch(samples, cluster=cluster_spec, cost_model=file, config=config, step=step,
                              reference_sample=reference)
            planned = _write(out_dir, "plan.json", plan.model_dump_json(indent=1))
            label = f"{workload}, step {step}"
        cost_model = CostModel(file=file, cluster=cluster_spec)
        base = (strongest_baseline_plan(plan, samples, cluster=cluster_spec, cost_model=file, config=config,
                                        reference_sample=reference) if baseline else None)
        data = PlanPictureInput(plan=plan, cost_model=cost_model, baseline=base, label=label)
        images = {fmt: plan_image(data, fmt) for fmt in ("png", "svg")}
        written = [] if plan_file is not None else [planned]
        written += [_write(out_dir, f"gantt.{fmt}", image) for fmt, image in images.items()]
        written += _memory_files(out_dir, plan, cost_model, label=label)
        from report.plan_html import plan_html

        written.append(_write(out_dir, "plan.html", plan_html(
            title=f"{label}: {plan.num_ranks} GPUs ({plan.cluster_name})", gantt_svg=images["svg"],
            memory_svg=(out_dir / "memory.svg").read_bytes())))
        if trace is not None:
            from planner.timeline import step_timeline
            from report.trace import plan_trace_json

            written.append(_write(trace.parent, trace.name,
                                  plan_trace_json(plan, step_timeline(plan, cost_model))))
    except ValueError as exc:
        fail(str(exc))
    typer.echo("wrote " + ", ".join(str(p) for p in written))


@app.command("epoch")
def report_epoch(
    store_path: Path = typer.Argument(..., exists=True, dir_okay=False, metavar="STORE",
                                      help="SQLite plan store (dcp epoch --out, dcp serve --db)."),
    epoch_id: str | None = typer.Option(None, "--epoch", "-e",
                                        help="Epoch id (default: the store's only epoch)."),
    gantt_step: int | None = typer.Option(None, "--step", "-k", min=0,
                                          help="Step whose Gantt chart the summary shows (default: "
                                               "the planned step with the largest gap)."),
    out_dir: Path = OUT_DIR,
) -> None:
    """An epoch's pictures: epoch.png and epoch.svg (speedup over each baseline and gap to the
    lower bound per step; the prediction error of the steps ranks measured, once they have),
    gantt-stepK.png/.svg and report.html (one self-contained page)."""
    from api.registry import CostModelRegistry
    from api.report_data import (
        EpochFiguresCache,
        epoch_info,
        epoch_title,
        prediction_errors,
        step_picture_input,
    )
    from api.store import PlanStore
    from report.epoch_report import epoch_image
    from report.html import epoch_html
    from report.plan_report import plan_image

    try:
        store = PlanStore.open(store_path)
    except (sqlite3.DatabaseError, ValueError) as exc:
        fail(f"STORE {store_path} is not a plan store ({exc}); give the file dcp epoch --out or "
             "dcp serve --db wrote")
    try:
        epochs = store.list_epochs()
        if epoch_id is None:
            if len(epochs) != 1:
                fail(f"--epoch: STORE {store_path} holds {len(epochs)} epochs "
                     f"({', '.join(r.id for r in epochs[:10]) or 'none'}); name one")
            epoch_id = epochs[0].id
        record = store.get_epoch(epoch_id)
        if record is None:
            fail(f"--epoch {epoch_id!r} is not in {store_path} (epochs: "
                 f"{', '.join(r.id for r in epochs[:10]) or 'none'})")
        steps = EpochFiguresCache().steps(store, record.id)
        if not steps:
            fail(f"epoch {record.id!r} has no planned step yet ({record.state})")
        if gantt_step is None:
            gantt_step = max(steps, key=lambda s: (s.gap, -s.step)).step
        elif gantt_step not in {s.step for s in steps}:
            fail(f"--step {gantt_step}: epoch {record.id!r} has no stored plan for it "
                 f"({len(steps)}/{record.steps_total} steps planned)")
        written = []
        errors = prediction_errors(store, record.id)
        images = {fmt: epoch_image(steps, title=epoch_title(record), fmt=fmt, errors=errors)
                  for fmt in ("png", "svg")}
        written += [_write(out_dir, f"epoch.{fmt}", data) for fmt, data in images.items()]
        gantt: dict[str, bytes] = {}
        note = None
        try:
            data = step_picture_input(store, record, gantt_step, get_cost_model=CostModelRegistry(store).get)
            gantt = {fmt: plan_image(data, fmt) for fmt in ("png", "svg")}
        except (KeyError, ValueError) as exc:  # the epoch's pictures are still written
            note = str(exc.args[0] if isinstance(exc, KeyError) else exc)
            typer.echo(f"warning: no Gantt chart of step {gantt_step}: {note}", err=True)
        written += [_write(out_dir, f"gantt-step{gantt_step}.{fmt}", b) for fmt, b in gantt.items()]
        page = epoch_html(epoch_info(record), steps, epoch_svg=images["svg"], gantt_svg=gantt.get("svg"),
                          gantt_step=gantt_step, errors=errors, gantt_note=note)
        written.append(_write(out_dir, "report.html", page))
    finally:
        store.close()
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def register(root: typer.Typer) -> None:
    """Add ``dcp report`` to the app."""
    root.add_typer(app, name="report",
                   short_help="Pictures of a plan (Gantt vs the strongest baseline) or an epoch (HTML).")
