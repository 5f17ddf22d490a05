"""What the memory a fitted cost model keeps free costs in step time: its margin and the planner's
safety fraction, priced on a workload and cluster preset (``dcp fit`` prints it).

A forced fit carries its held-out under-prediction as ``memory_margin_fraction`` ``m``; the
planner keeps ``max(memory_safety_fraction, m/(1+m))`` of the activation budget free (never the
two stacked, ``MemoryCosts.reserved_budget_fraction``). Planning the same sampled batches with
nothing kept free, with the safety fraction alone and with the reserve the file gets shows what
each costs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from costmodel.memory_costs import reserved_fraction
from costmodel.presets import cluster_names, load_cluster, load_hardware, load_model, workload_names
from costmodel.schema import CostModelFile

PRICE_STEPS = 2
"""Sampled steps priced."""
PRICE_BATCH = 64
"""Samples per priced step."""
PRICE_BUDGET_S = 0.05
"""Planner budget per priced step (the 50 ms preset)."""


def default_preset(file: CostModelFile) -> tuple[str, str] | None:
    """A ``(workload, cluster)`` preset pair to price ``file`` on: the first workload whose model
    has the file's shape and the first cluster preset of the file's hardware (None without one)."""
    from planner.workload import WorkloadSpec

    try:
        load_hardware(file.hardware)
    except ValueError:
        return None
    clusters = [name for name in cluster_names() if load_cluster(name).hardware.name == file.hardware]
    workloads = [name for name in workload_names()
                 if not load_model(WorkloadSpec.preset(name).model).shape_differences(file.model)]
    return (workloads[0], clusters[0]) if clusters and workloads else None


def price_reserve(file: CostModelFile, *, workload: str, cluster: str, safety_fraction: float,
                  seed: int = 0) -> dict[str, Any]:
    """Mean predicted step time over ``PRICE_STEPS`` sampled batches with nothing kept free, with
    the safety fraction alone, and with the file's reserve (its margin or the safety fraction,
    the larger); ``None`` times where a plan is refused (``refusals`` says why).

    Raises:
        ValueError: for an unknown preset or a file that does not fit the cluster or workload.
    """
    from costmodel.evaluate import CostModel
    from planner.config import PlannerConfig
    from planner.planning import plan_batch
    from planner.workload import WorkloadSpec, sample_batch

    spec = WorkloadSpec.preset(workload)
    cluster_spec = load_cluster(cluster)
    differ = file.model.shape_differences(load_model(spec.model))
    if differ:
        raise ValueError(f"workload {workload!r} trains {spec.model!r}, another shape than the fitted model "
                         f"({'; '.join(differ)})")
    bare = file.model_copy(update={"activation": file.activation.model_copy(update={"memory_margin_fraction": 0.0})})
    margin = file.activation.memory_margin_fraction
    reserved = CostModel(file=file, cluster=cluster_spec).reserved_budget_fraction(safety_fraction)
    cases = {"nothing kept free": (bare, 0.0), f"safety fraction {safety_fraction:.3f}": (bare, safety_fraction),
             f"reserve {reserved:.3f} (this file)": (file, safety_fraction)}
    base = PlannerConfig.for_budget(PRICE_BUDGET_S, seed=seed)
    times: dict[str, float | None] = {}
    refusals: dict[str, str] = {}
    for label, (cost_model, fraction) in cases.items():
        config = dataclasses.replace(base, memory_safety_fraction=fraction)
        total: float | None = 0.0
        for step in range(PRICE_STEPS):
            samples = sample_batch(spec, num_samples=PRICE_BATCH, seed=seed, step=step)
            try:
                plan = plan_batch(samples, cluster=cluster_spec, cost_model=cost_model, config=config, step=step,
                                  reference_sample=spec.max_sample)
            except ValueError as exc:  # a sample that fits nowhere under this reserve
                total, refusals[label] = None, str(exc)
                break
            total = (total or 0.0) + plan.predicted_step_time_s
        times[label] = None if total is None else total / PRICE_STEPS
    free = times["nothing kept free"]
    return {"workload": workload, "cluster": cluster, "margin": margin, "safety_fraction": safety_fraction,
            "reserved_fraction": reserved, "steps": PRICE_STEPS, "batch_size": PRICE_BATCH,
            "step_time_s": times, "refusals": refusals,
            "slowdown": {k: (v / free - 1.0 if v is not None and free else None) for k, v in times.items()}}


def reserve_summary(file: Any, *, price_on: str, safety_fraction: float) -> dict[str, Any]:
    """The file's margin and the safety fraction, priced in step time on ``price_on``
    (``WORKLOAD@CLUSTER``, ``auto`` or ``none``; ``dcp_cli.fit_reserve``)."""
    margin = file.activation.memory_margin_fraction
    out: dict[str, Any] = {"margin": margin, "safety_fraction": safety_fraction,
                           "reserved_fraction": reserved_fraction(safety_fraction, margin), "priced": None}
    if price_on == "none":
        return out
    if price_on == "auto":
        pair = default_preset(file)
        if pair is None:
            out["not_priced"] = (f"no workload preset of this model's shape on a cluster preset of hardware "
                                 f"{file.hardware!r}: pass --price-on WORKLOAD@CLUSTER")
            return out
    else:
        workload, sep, cluster = price_on.partition("@")
        if not sep or not workload or not cluster:
            raise typer.BadParameter(f"--price-on {price_on!r} is not WORKLOAD@CLUSTER, auto or none")
        pair = (workload, cluster)
    try:
        out["priced"] = price_reserve(file, workload=pair[0], cluster=pair[1], safety_fraction=safety_fraction)
    except ValueError as exc:
        raise typer.BadParameter(f"--price-on {price_on!r}: {exc}") from None
    return out


def reserve_table(reserve: dict[str, Any], console: Console) -> None:
    """Print the margin, the safety fraction and their step-time cost."""
    console.print(f"memory kept free by plans: margin {reserve['margin']:.1%} of the activations "
                  f"(forced fit's held-out under-prediction; 0 when not forced), safety fraction "
                  f"{reserve['safety_fraction']:.1%} of the budget: plans keep {reserve['reserved_fraction']:.1%} "
                  "free, the larger of the two, never both")
    priced = reserve["priced"]
    if priced is None:
        if "not_priced" in reserve:
            console.print(f"not priced: {reserve['not_priced']}")
        return
    table = Table(title=f"step time on {priced['workload']} @ {priced['cluster']} "
                        f"({priced['steps']} steps of {priced['batch_size']} samples)")
    for col in ("memory kept free", "step time", "vs nothing kept free"):
        table.add_column(col, justify="right")
    for label, time_s in priced["step_time_s"].items():
        slow = priced["slowdown"][label]
        table.add_row(label, "refused" if time_s is None else f"{time_s:.4g} s",
                      "" if slow is None else f"{slow:+.2%}")
    console.print(table)
