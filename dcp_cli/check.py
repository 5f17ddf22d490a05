"""``dcp check-model``: the cost model against the executor, measured on this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from dcp_cli.style import console, fail, fmt_pct, print_table, require_parent

COLUMNS = [
    ("step/g/mb", "step, group and micro-batch of the plan"),
    ("d", "SP group size"),
    ("tokens", "tokens in the micro-batch (samples)"),
    ("k", "checkpoint policy per sample (layers recomputed)"),
    ("ms", "measured forward+backward, slowest rank, fastest repeat"),
    ("pred ms", "the cost model's prediction (fitted with the same clock)"),
    ("MB", "measured peak of live bytes above the start (largest rank)"),
    ("pred MB", "the cost model's peak of the micro-batch, model states excluded"),
]


def report_table(report: dict[str, Any]) -> Table:
    """One row per micro-batch of a ``model_check`` report."""
    table = Table(box=None, pad_edge=False)
    for name, _ in COLUMNS:
        table.add_column(name, justify="left" if name in ("step/g/mb", "k") else "right")
    for r in report["micro_batches"]:
        table.add_row(f"{r['step']}/{r['group']}/{r['micro_batch']}", str(r["group_size"]),
                      f"{r['tokens']} ({r['num_samples']})", ",".join(map(str, r["policies"])),
                      f"{r['time_s'] * 1e3:.1f}", f"{r['predicted_time_s'] * 1e3:.1f}",
                      f"{r['peak_bytes'] / 1e6:.2f}", f"{r['predicted_peak_bytes'] / 1e6:.2f}")
    return table


def summary_line(report: dict[str, Any]) -> str:
    """The errors of a report in one line."""
    s = report["summary"]
    return (f"{s['micro_batches']} micro-batches: time MAPE {fmt_pct(s['time_mape'])} (bias "
            f"{s['time_bias']:+.1%}), per group {fmt_pct(s['group_time_mape'])}; peak memory MAPE "
            f"{fmt_pct(s['peak_mape'])} (max {fmt_pct(s['peak_max_error'])}); "
            f"{s['checkpointed_micro_batches']} checkpointed, {s['mixed_policy_micro_batches']} mixed")


def register(app: typer.Typer) -> None:
    """Add ``dcp check-model`` to the app."""

    @app.command("check-model")
    def check_model(
        kind: str = typer.Option("1d", help="Reference model: 1d (LLaMA-style), 2d (STDiT-style) or 3d "
                                            "(full-3D-attention DiT, Wan-style)."),
        world: int = typer.Option(2, help="gloo ranks (one thread each)."),
        layers: int = typer.Option(4, help="Layers of the reference model."),
        hidden: int = typer.Option(64, help="Hidden size."),
        heads: int = typer.Option(4, help="Attention heads."),
        kv_heads: int = typer.Option(
            0, help="Key/value heads of the self-attention (0 = --heads); groups past them replicate "
                    "each key/value head (grouped-query attention)."),
        ffn: int = typer.Option(128, help="MLP size."),
        steps: int = typer.Option(3, help="Planned steps to run."),
        samples: int = typer.Option(8, help="Samples per step."),
        tokens_min: int = typer.Option(32, help="Shortest sample in tokens."),
        tokens_max: int = typer.Option(1024, help="Longest sample in tokens."),
        memory_tokens: int = typer.Option(
            600, help="Memory per rank for about this many tokens without checkpointing (plans then "
                      "checkpoint and mix policies); 0 = roomy."),
        clock: str = typer.Option(
            "thread", help="thread: each rank's CPU time (robust on a busy machine; all-to-all "
                           "excluded on both sides); wall: elapsed time (needs a quiet machine)."),
        repeats: int = typer.Option(5, help="Timed repeats per micro-batch and per profiled point."),
        sweep_sizes: int = typer.Option(
            6, help="Sample sizes in the compute profile's sweep, each at every layer count and "
                    "checkpoint policy (fewer: a faster, coarser fit)."),
        concurrent: bool = typer.Option(
            True, help="Ranks share this machine: profile with every rank sweeping at once and run "
                       "one-rank groups at once, as in training (--no-concurrent: one at a time)."),
        cost_model: Path | None = typer.Option(
            None, help="Check this fitted file instead of profiling and fitting first."),
        out: Path | None = typer.Option(None, help="Write the report as JSON here."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the summary line."),
    ) -> None:
        """Fit a cost model to the executor's own layers on this machine (or take one), run real
        plans through the executor on gloo ranks, and compare measured with predicted time and
        peak memory per micro-batch and per group."""
        if out is not None:
            require_parent(out, option="--out")
        try:
            from dcp_cli import model_check
        except ImportError as exc:
            fail(f"dcp check-model needs torch: pip install 'dcp-planner[torch]' ({exc})")
        from costmodel.schema import CostModelFile

        try:
            config = model_check.CheckConfig(
                kind=kind,  # type: ignore[arg-type]
                world_size=world, num_layers=layers, hidden=hidden, num_heads=heads, ffn_hidden=ffn,
                num_kv_heads=kv_heads or None, num_steps=steps, samples_per_step=samples, tokens_min=tokens_min,
                tokens_max=tokens_max, memory_tokens=memory_tokens,
                clock=clock,  # type: ignore[arg-type]
                sweep_sizes=sweep_sizes, sweep_repeats=repeats, repeats=repeats, concurrent=concurrent)
            if kind not in ("1d", "2d", "3d"):
                raise ValueError(f"--kind {kind!r} is not 1d, 2d or 3d")
            file = CostModelFile.load(cost_model) if cost_model is not None else None
        except (ValueError, OSError) as exc:
            fail(str(exc))
        say = None if quiet else (lambda text: console().print(f"[dim]{text}[/dim]"))
        report = model_check.run_check(config, progress=say, cost_model=file)
        if not quiet:
            print_table(report_table(report), COLUMNS)
        console().print(summary_line(report))
        if out is not None:
            out.write_text(json.dumps(report, indent=1) + "\n")
