"""``dcp presets``: the models, hardware, clusters, workloads and cost models that ship."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import typer
from rich import box
from rich.table import Table

from dcp_cli.style import console, fmt_count, print_table


class Kind(StrEnum):
    """Which presets to list."""

    all = "all"
    models = "models"
    hardware = "hardware"
    clusters = "clusters"
    workloads = "workloads"
    cost_models = "cost-models"


def preset_records() -> dict[str, list[dict[str, Any]]]:
    """Every shipped preset, by kind, as plain dicts (``costmodel.presets.preset_records``)."""
    from costmodel.presets import preset_records as records

    return records()


def _table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 or col in ("kind", "model", "hardware", "about")
                         else "right", overflow="fold")
    return table


def print_presets(records: dict[str, list[dict[str, Any]]], kinds: list[str]) -> None:
    """One table per kind, each with a legend (80 columns)."""
    out = console()
    first = True

    def gap() -> None:
        nonlocal first
        if not first:
            out.print()
        first = False

    if "models" in kinds:
        gap()
        t = _table("Models (--model)", ["name", "kind", "layers", "hidden", "heads", "kv", "ffn", "vocab"])
        for m in records["models"]:
            t.add_row(m["name"], m["kind"], str(m["num_layers"]), fmt_count(m["hidden"]), str(m["num_heads"]),
                      str(m.get("num_kv_heads") or m["num_heads"]), fmt_count(m["ffn_hidden"]),
                      fmt_count(m["vocab"]) if m["vocab"] else "-")
        print_table(t, [("name", "what --model takes (--model-config reads a config.json instead; "
                                 "examples/configs/ holds those of the public models)"),
                        ("kind", "1d: text decoder; 2d: spatial+temporal video DiT; 3d: full-3D-attention "
                                 "video DiT"),
                        ("layers", "transformer layers (2d: spatial+temporal block pairs)"),
                        ("hidden, ffn", "hidden and MLP inner sizes"),
                        ("heads, kv", "attention and key/value heads; SP group sizes divide the heads and "
                                      "divide or are a multiple of kv"),
                        ("vocab", "vocabulary (1d only)")], out=out)
    if "hardware" in kinds:
        gap()
        t = _table("Hardware", ["name", "HBM GB", "HBM TB/s", "bf16 TFLOP/s", "NVLink GB/s", "net GB/s"])
        for h in records["hardware"]:
            t.add_row(h["name"], f"{h['hbm_bytes'] / 1e9:.0f}", f"{h['hbm_bandwidth_bytes_per_s'] / 1e12:.1f}",
                      f"{h['bf16_dense_flops'] / 1e12:.0f}", f"{h['nvlink_bytes_per_s_per_direction'] / 1e9:.0f}",
                      f"{h['network_bytes_per_s_per_gpu'] / 1e9:.0f}")
        print_table(t, [("name", "accelerator; a cost model is for one model on one of these"),
                        ("HBM GB, TB/s", "device memory (1e9 bytes) and its bandwidth"),
                        ("bf16 TFLOP/s", "peak dense bf16 compute"),
                        ("NVLink GB/s", "intra-node link bandwidth per GPU and direction"),
                        ("net GB/s", "inter-node network bandwidth per GPU")], out=out)
    if "clusters" in kinds:
        gap()
        t = _table("Clusters (--cluster)", ["name", "hardware", "GPUs", "per node", "memory cap", "states"])
        for c in records["clusters"]:
            t.add_row(c["name"], c["hardware"]["name"], str(c["num_gpus"]), str(c["gpus_per_node"]),
                      f"{c['memory_cap_fraction']:.0%}", str(c.get("state_sharding", "")))
        print_table(t, [("name", "what --cluster (and the API's cluster) takes"),
                        ("hardware", "the accelerator of every rank (see Hardware)"),
                        ("GPUs, per node", "world size N and GPUs per node G (NVLink inside a node)"),
                        ("memory cap", "share of device memory the planner may fill"),
                        ("states", "how optimizer states are held: replicated or zero1 (sharded), the two the "
                                   "executor runs")], out=out)
    if "workloads" in kinds:
        gap()
        t = _table("Workloads (--workload)", ["name", "kind", "model", "about"])
        for w in records["workloads"]:
            t.add_row(w["name"], w["kind"], w["model"], w.get("description", ""))
        print_table(t, [("name", "what --workload takes (dcp plan, dcp manifest)"),
                        ("kind", "1d: token lengths from a distribution; 2d: frames x height x width buckets"),
                        ("model", "the model preset the workload is planned for"),
                        ("about", "where the shapes come from")], out=out)
    if "cost-models" in kinds:
        gap()
        t = _table("Embedded cost models (--cost-model, cost_model_id)", ["id", "model", "hardware"])
        for f in records["cost-models"]:
            t.add_row(f["id"], f["model"], f["hardware"])
        print_table(t, [("id", "analytic cost model of a model preset on a hardware preset; "
                               "dcp fit makes fitted ones"),
                        ("model, hardware", "the presets it was derived from")], out=out)


def register(app: typer.Typer) -> None:
    """Add ``dcp presets`` to the app."""

    @app.command("presets")
    def presets(
        kind: Kind = typer.Argument(Kind.all, help="Which presets to list."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    ) -> None:
        """List the shipped models, hardware, clusters, workloads and embedded cost models."""
        records = preset_records()
        kinds = list(records) if kind == Kind.all else [kind.value]
        if as_json:
            typer.echo(json.dumps({k: records[k] for k in kinds}, indent=1))
            return
        print_presets(records, kinds)
