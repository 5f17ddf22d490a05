"""``dcp cost``: what the cost model predicts for a few sample shapes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dcp_cli.model_option import apply_loss_chunk, loss_chunk_option, model_config_option, model_option, resolve_model
from dcp_cli.style import GIB, fmt_count, fmt_gib, fmt_ms, fmt_s, legend
from dcp_cli.style import console as make_console

if TYPE_CHECKING:
    from costmodel.evaluate import CostModel
    from costmodel.specs import Sample


def parse_shape(text: str, index: int) -> Sample:
    """``8192`` is a 1D sample of 8192 tokens; ``15x22x40`` a 2D sample (frames x h x w).

    Raises:
        typer.BadParameter: naming the shape.
    """
    from costmodel.specs import Sample

    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        raise typer.BadParameter(f"shape {text!r} is not TOKENS or FRAMESxHEIGHTxWIDTH") from None
    if any(p <= 0 for p in parts):
        raise typer.BadParameter(f"shape {text!r}: tokens, frames, height and width must be positive")
    try:
        if len(parts) == 1:
            return Sample(id=f"shape{index}", tokens=parts[0])
        if len(parts) == 3:
            return Sample(id=f"shape{index}", frames=parts[0], height=parts[1], width=parts[2],
                          tokens=parts[0] * parts[1] * parts[2])
    except ValueError as exc:
        raise typer.BadParameter(f"shape {text!r}: {exc}") from None
    raise typer.BadParameter(f"shape {text!r} is not TOKENS or FRAMESxHEIGHTxWIDTH")


def cost_rows(cost_model: CostModel, samples: list[Sample]) -> list[dict[str, Any]]:
    """One row per sample x allowed group size: time and memory per policy, all-to-all time."""
    from costmodel.efficiency_report import kernel_efficiencies
    from costmodel.evaluate import policy_name

    layers = cost_model.num_layers
    policies = sorted({0, layers // 2, layers})
    rows = []
    for sample in samples:
        for d in cost_model.allowed_group_sizes():
            a2a_bytes = cost_model.file.comm.alltoall_bytes_per_token_layer * sample.tokens / d
            a2a_ops = max(cost_model.file.comm.alltoall_ops_per_layer, 1)
            a2a_layer_s = a2a_ops * float(cost_model.alltoall_time_s(a2a_bytes / a2a_ops, group_size=d))
            row: dict[str, Any] = {
                "sample": sample.id, "tokens": sample.tokens, "frames": sample.frames,
                "height": sample.height, "width": sample.width, "group_size": d,
                "alltoall_time_s_per_layer": a2a_layer_s,
            }
            for k in policies:
                name = policy_name(k, layers)
                row[f"time_s_{name}"] = float(cost_model.sample_time_s(
                    sample.tokens, group_size=d, recompute_layers=k, frames=sample.num_frames,
                    spatial=sample.spatial_tokens))
                row[f"activation_bytes_{name}"] = float(cost_model.activation_bytes(
                    sample.tokens, group_size=d, recompute_layers=k))
            row["fits_full"] = cost_model.fits(sample, group_size=d, recompute_layers=layers)
            eff = kernel_efficiencies(cost_model, tokens=sample.tokens, group_size=d, frames=sample.num_frames,
                                      spatial=sample.spatial_tokens)
            row["gemm_efficiency"] = eff.gemm
            row["attention_forward_efficiency"] = eff.attention_forward
            row["attention_backward_efficiency"] = eff.attention_backward
            rows.append(row)
    return rows


def register(app: typer.Typer) -> None:
    """Add ``dcp cost`` to the app."""

    @app.command("cost")
    def cost(
        shapes: list[str] = typer.Argument(..., metavar="SHAPE", help="TOKENS (1D) or FRAMESxHEIGHTxWIDTH (2D)."),
        model: str | None = model_option(help_text="Model preset (default llama-7b; dcp presets models)."),
        model_config: Path | None = model_config_option(),
        loss_chunk_tokens: int | None = loss_chunk_option(),
        cluster: str = typer.Option("h200x8", help="Cluster preset."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Predicted time, activation memory per policy and all-to-all time per group size."""
        from costmodel.analytic import analytic_cost_model
        from costmodel.evaluate import CostModel
        from costmodel.model_choice import check_samples_kind
        from costmodel.presets import load_cluster

        spec = resolve_model(model, model_config, default="llama-7b")
        assert spec is not None
        samples = [parse_shape(text, i) for i, text in enumerate(shapes)]
        spec = apply_loss_chunk(spec, loss_chunk_tokens, max_sample_tokens=max(s.tokens for s in samples))
        try:
            cluster_spec = load_cluster(cluster)
            cm = CostModel(file=analytic_cost_model(spec, cluster_spec.hardware), cluster=cluster_spec)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        try:
            check_samples_kind(samples, spec, source="SHAPE")
        except ValueError as exc:
            form = "FRAMESxHEIGHTxWIDTH" if spec.is_video else "TOKENS"
            raise typer.BadParameter(f"{exc}: give shapes as {form}") from None
        rows = cost_rows(cm, samples)
        console = make_console()
        if as_json:
            payload = {
                "cost_model_id": cm.file.id, "cluster": cm.cluster.name,
                "model_state_bytes_per_gpu": cm.model_state_bytes(),
                "loss_chunk_tokens": spec.loss_chunk_tokens if not spec.is_video else None,
                "loss_chunk_bytes": cm.file.activation.loss_chunk_bytes,
                "fixed_bytes": cm.fixed_bytes(),
                "activation_budget_bytes": cm.activation_budget_bytes(),
                "grad_sync_time_s": cm.grad_sync_time_s(), "rows": rows,
            }
            typer.echo(json.dumps(payload, indent=1))
            return
        print_cost_tables(cm, rows, console)


LONG_TIME_S = 100.0
"""A sample table whose longest time reaches this shows seconds instead of milliseconds."""


def _whole_from_1000(fmt: Callable[[float], str], unit: float = 1.0) -> Callable[[float], str]:
    """``fmt``, but values of 1,000 units or more as whole numbers (``29,957``), so a column of a
    16M-token sample stays narrow enough for the table's 80 columns."""
    return lambda value: f"{value / unit:,.0f}" if value / unit >= 1000 else fmt(value)


def _efficiency_line(sample_rows: list[dict[str, Any]]) -> str:
    """The kernel efficiencies of one sample's rows: GEMMs per group size, attention per pass."""
    gemm = ", ".join(f"d={r['group_size']} {100 * r['gemm_efficiency']:.0f}%" for r in sample_rows)
    att = ", ".join(sorted({f"{100 * r['attention_forward_efficiency']:.0f}%/"
                            f"{100 * r['attention_backward_efficiency']:.0f}%" for r in sample_rows}))
    return f"efficiency: GEMM {gemm}; attention forward/backward {att}"


def _short_policy(name: str) -> str:
    return name.replace("selective-", "sel")


def print_cost_tables(cm: CostModel, rows: list[dict[str, Any]], console: Console) -> None:
    """One table per sample (80 columns wide), then a legend of the columns."""
    from costmodel.evaluate import policy_name

    layers = cm.num_layers
    policies = [policy_name(k, layers) for k in sorted({0, layers // 2, layers})]
    console.print(f"[bold]{cm.file.id}[/bold] on [bold]{cm.cluster.name}[/bold]: model states "
                  f"{fmt_gib(cm.model_state_bytes())} GiB/GPU, activation budget "
                  f"{fmt_gib(cm.activation_budget_bytes())} GiB/GPU, gradient sync "
                  f"{fmt_ms(cm.grad_sync_time_s())} ms per step")
    if not cm.file.model.is_video:
        chunk = cm.file.model.loss_chunk_tokens
        console.print(f"LM loss: {'whole logits' if chunk == 0 else f'chunks of {fmt_count(chunk)} tokens'}"
                      f" ({fmt_gib(cm.file.activation.loss_chunk_bytes)} GiB/GPU for one chunk, "
                      f"{fmt_count(round(cm.file.activation.working_bytes_per_token))} B/token of working "
                      "buffers; --loss-chunk-tokens)")
    by_sample: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_sample.setdefault(r["sample"], []).append(r)
    for sample_rows in by_sample.values():
        first = sample_rows[0]
        shape = (f"{first['frames']}x{first['height']}x{first['width']} = " if first["frames"] else "")
        # Seconds where milliseconds would not fit 80 columns (a sample of a million tokens on one
        # GPU takes ~1,900,000 ms): every number shown whole, never cut to "...".
        in_s = max(r[f"time_s_{p}"] for r in sample_rows for p in policies) >= LONG_TIME_S
        fmt_time = _whole_from_1000(fmt_s) if in_s else fmt_ms
        table = Table(title=f"{shape}{fmt_count(first['tokens'])} tokens" + (" (times in s)" if in_s else ""),
                      box=box.SIMPLE_HEAD, title_justify="left", padding=(0, 1))
        table.add_column("d", justify="right")
        for p in policies:
            table.add_column(f"time {_short_policy(p)}", justify="right")
        for p in policies:
            table.add_column(f"act {_short_policy(p)}", justify="right")
        table.add_column("a2a", justify="right")
        table.add_column("fits", justify="right")
        for r in sample_rows:
            table.add_row(str(r["group_size"]), *[fmt_time(r[f"time_s_{p}"]) for p in policies],
                          *[_whole_from_1000(fmt_gib, GIB)(r[f"activation_bytes_{p}"]) for p in policies],
                          fmt_ms(r["alltoall_time_s_per_layer"]) if r["group_size"] > 1 else "-",
                          "yes" if r["fits_full"] else "no")
        console.print(table)
        console.print(_efficiency_line(sample_rows))
    sel = next((p for p in policies if p.startswith("selective-")), None)
    entries = [("d", "sequence-parallel group size: GPUs that share the sample (Ulysses)")]
    entries += [(f"time {_short_policy(p)}", f"predicted forward+backward time of the sample, ms (s where "
                 f"the title says so), with checkpoint policy {p}") for p in policies[:1]]
    entries += [("", "none: keep all activations; full: recompute every layer"
                 + (f"; {_short_policy(sel)}: recompute {sel.split('-')[1]} of {layers} layers" if sel else ""))]
    entries += [("act P", "activation memory of the sample per GPU, GiB, with policy P"),
                ("a2a", "all-to-all time per layer (forward), ms; - on one GPU"),
                ("efficiency", "shares of peak FLOP/s the time is priced at: GEMMs on the sample's "
                               "tokens / d rows per GPU, attention forward/backward at the sequence length "
                               "its kernel runs on (docs/cost-model.md: published curves for H100, H200, B200)"),
                ("fits", "fits the activation budget on d GPUs with full recompute")]
    entries[1] = ("time P", entries[1][1].replace(f"policy {policies[0]}", "policy P"))
    console.print(Text("Columns:", style="bold"))
    console.print(legend(entries))
