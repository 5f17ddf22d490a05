"""``dcp cost``: what the cost model predicts for a few sample shapes."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from costmodel.evaluate import CostModel, policy_name
from costmodel.presets import default_cost_model, load_cluster
from costmodel.specs import Sample

GIB = 1024**3


def parse_shape(text: str, index: int) -> Sample:
    """``8192`` is a 1D sample of 8192 tokens; ``15x22x40`` a 2D sample (frames x h x w).

    Raises:
        typer.BadParameter: naming the shape.
    """
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        raise typer.BadParameter(f"shape {text!r} is not TOKENS or FRAMESxHEIGHTxWIDTH") from None
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
            rows.append(row)
    return rows


def register(app: typer.Typer) -> None:
    """Add ``dcp cost`` to the app."""

    @app.command("cost")
    def cost(
        shapes: list[str] = typer.Argument(..., help="TOKENS (1D) or FRAMESxHEIGHTxWIDTH (2D)."),
        model: str = typer.Option("llama-7b", help="Model preset."),
        cluster: str = typer.Option("h200x8", help="Cluster preset."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Predicted time, activation memory per policy and all-to-all time per group size."""
        try:
            cm = default_cost_model(model, load_cluster(cluster))
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        samples = [parse_shape(text, i) for i, text in enumerate(shapes)]
        if cm.is_2d and any(not s.is_2d for s in samples):
            raise typer.BadParameter(f"model {model!r} is 2D: give shapes as FRAMESxHEIGHTxWIDTH")
        rows = cost_rows(cm, samples)
        console = Console()
        if as_json:
            payload = {
                "cost_model_id": cm.file.id, "cluster": cm.cluster.name,
                "model_state_bytes_per_gpu": cm.model_state_bytes(),
                "activation_budget_bytes": cm.activation_budget_bytes(),
                "grad_sync_time_s": cm.grad_sync_time_s(), "rows": rows,
            }
            typer.echo(json.dumps(payload, indent=1))
            return
        layers = cm.num_layers
        policies = [policy_name(k, layers) for k in sorted({0, layers // 2, layers})]
        table = Table(title=f"{cm.file.id} on {cm.cluster.name} "
                            f"(states {cm.model_state_bytes() / GIB:.1f} GiB/GPU, "
                            f"activation budget {cm.activation_budget_bytes() / GIB:.1f} GiB, "
                            f"grad sync {cm.grad_sync_time_s() * 1e3:.1f} ms)")
        for col in ["sample", "tokens", "d", *[f"time {p} (ms)" for p in policies],
                    *[f"act {p} (GiB)" for p in policies], "a2a/layer (ms)"]:
            table.add_column(col, justify="right")
        for r in rows:
            shape = f"{r['frames']}x{r['height']}x{r['width']}" if r["frames"] else str(r["tokens"])
            table.add_row(
                shape, str(r["tokens"]), str(r["group_size"]),
                *[f"{r[f'time_s_{p}'] * 1e3:.2f}" for p in policies],
                *[f"{r[f'activation_bytes_{p}'] / GIB:.2f}" for p in policies],
                f"{r['alltoall_time_s_per_layer'] * 1e3:.3f}",
            )
        console.print(table)
