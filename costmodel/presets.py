"""Presets shipped as data files: models, hardware, clusters, benchmark workloads.

The JSON files under ``costmodel/presets/`` are this project's model, hardware, cluster and
workload presets and ship with the wheel. Fitted cost models committed by the profiling stage live in
``costmodel/presets/fitted/``.
"""

from __future__ import annotations

import json
import os
from functools import cache
from importlib import resources
from typing import Any

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, HardwareSpec, ModelSpec

_PRESETS = "presets"


def _read_json(*parts: str) -> Any:
    node = resources.files("costmodel").joinpath(_PRESETS, *parts)
    return json.loads(node.read_text())


def _unknown(kind: str, name: str, known: list[str]) -> ValueError:
    return ValueError(f"unknown {kind} preset {name!r}; known: {', '.join(sorted(known))}")


@cache
def _models() -> dict[str, ModelSpec]:
    return {name: ModelSpec(name=name, **spec) for name, spec in _read_json("models.json").items()}


@cache
def _hardware() -> dict[str, HardwareSpec]:
    return {name: HardwareSpec(name=name, **spec) for name, spec in _read_json("hardware.json").items()}


def model_names() -> list[str]:
    """Names of the model presets."""
    return sorted(_models())


def hardware_names() -> list[str]:
    """Names of the hardware presets."""
    return sorted(_hardware())


def cluster_names() -> list[str]:
    """Names of the cluster presets."""
    return sorted(_read_json("clusters.json"))


def workload_names() -> list[str]:
    """Names of the benchmark workload presets."""
    folder = resources.files("costmodel").joinpath(_PRESETS, "workloads")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_model(name: str) -> ModelSpec:
    """A model preset by name.

    Raises:
        ValueError: naming the unknown preset and the known ones.
    """
    models = _models()
    if name not in models:
        raise _unknown("model", name, list(models))
    return models[name]


def load_hardware(name: str) -> HardwareSpec:
    """A hardware preset by name."""
    hardware = _hardware()
    if name not in hardware:
        raise _unknown("hardware", name, list(hardware))
    return hardware[name]


CPU_HARDWARE = "cpu"
"""Hardware name of CPU worlds (gloo ranks); cost models for it come from ``dcp fit`` on a CPU."""


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: a plain 16 GiB
        return 16.0 * 2**30


def cpu_cluster(num_ranks: int, *, ranks_per_node: int | None = None, memory_bytes: float | None = None
                ) -> ClusterSpec:
    """A world of CPU ranks (gloo), for planning with a cost model fitted on a CPU.

    Args:
        num_ranks: Ranks in the world.
        ranks_per_node: Ranks per host (default: all on one host).
        memory_bytes: Memory per rank (default: this host's memory shared by a node's ranks).

    Raises:
        ValueError: for a non-positive rank count or ranks that do not fill whole nodes.
    """
    per_node = num_ranks if ranks_per_node is None else ranks_per_node
    if num_ranks <= 0 or per_node <= 0:
        raise ValueError(f"a CPU cluster needs positive ranks, got {num_ranks} ranks, {per_node} per node")
    mem = memory_bytes if memory_bytes is not None else _host_memory_bytes() / per_node
    # Only the memory is read when a fitted model is used; the rates are a plain host's.
    hardware = HardwareSpec(name=CPU_HARDWARE, hbm_bytes=mem, hbm_bandwidth_bytes_per_s=20e9,
                            bf16_dense_flops=1e11, nvlink_bytes_per_s_per_direction=5e9,
                            network_bytes_per_s_per_gpu=1e9)
    return ClusterSpec(name=f"cpu:{num_ranks}x{per_node}", hardware=hardware, num_gpus=num_ranks,
                       gpus_per_node=per_node)


def _parse_cpu_cluster(name: str) -> ClusterSpec:
    """``cpu:N`` (one host) or ``cpu:NxG`` (G ranks per host)."""
    body = name.removeprefix("cpu:")
    try:
        ranks, _, per_node = body.partition("x")
        return cpu_cluster(int(ranks), ranks_per_node=int(per_node) if per_node else None)
    except ValueError as exc:
        raise ValueError(f"cluster {name!r}: expected cpu:N or cpu:NxG with positive integers ({exc})") from None


def _sized_cluster(name: str, clusters: dict[str, Any]) -> dict[str, Any] | None:
    """``<kind>x<N>`` for a size no preset has: the preset of that kind (its hardware and node
    size) with ``N`` GPUs (whole nodes), e.g. ``h200x24``, ``h200x48``."""
    kind, sep, count = name.rpartition("x")
    if not sep or not count.isdigit():
        return None
    like = sorted((c for c in clusters if c.rpartition("x")[0] == kind), key=lambda c: clusters[c]["num_gpus"])
    if not like:
        return None
    spec = dict(clusters[like[-1]])
    num_gpus, per_node = int(count), int(spec["gpus_per_node"])
    if num_gpus <= 0 or num_gpus % per_node:
        raise ValueError(f"cluster {name!r}: {num_gpus} GPUs do not fill whole nodes of {per_node} "
                         f"(as {like[-1]!r} has)")
    spec["num_gpus"] = num_gpus
    return spec


def load_cluster(name: str, **overrides: Any) -> ClusterSpec:
    """A cluster preset by name (or ``cpu:N`` / ``cpu:NxG`` for CPU ranks, or ``<kind>x<N>`` for
    a preset kind at another size, e.g. ``h200x48``), with optional field overrides (e.g.
    ``memory_cap_fraction``)."""
    if name.startswith("cpu:"):
        spec_cpu = _parse_cpu_cluster(name)
        return spec_cpu.model_copy(update=overrides) if overrides else spec_cpu
    clusters = _read_json("clusters.json")
    sized = _sized_cluster(name, clusters) if name not in clusters else None
    if name not in clusters and sized is None:
        raise _unknown("cluster", name, [*clusters, "cpu:N", "cpu:NxG", "<kind>x<N>"])
    spec = dict(clusters[name]) if sized is None else sized
    spec["hardware"] = load_hardware(spec["hardware"])
    spec.update(overrides)
    return ClusterSpec(name=name, **spec)


def load_workload_spec(name: str) -> dict[str, Any]:
    """The raw JSON of a benchmark workload preset (``dcp-workload/1``)."""
    if name not in workload_names():
        raise _unknown("workload", name, workload_names())
    spec: dict[str, Any] = _read_json("workloads", f"{name}.json")
    return spec


def fitted_cost_models() -> list[CostModelFile]:
    """Fitted cost models shipped as presets (may be empty)."""
    folder = resources.files("costmodel").joinpath(_PRESETS, "fitted")
    if not folder.is_dir():
        return []
    return [CostModelFile.model_validate_json(p.read_text())
            for p in sorted(folder.iterdir(), key=lambda p: p.name) if p.name.endswith(".json")]


def default_cost_model_file(model: str, hardware: str) -> CostModelFile:
    """The analytic default cost model for a model and hardware preset."""
    return analytic_cost_model(load_model(model), load_hardware(hardware))


def default_cost_model(model: str, cluster: str | ClusterSpec) -> CostModel:
    """The analytic default cost model of a model preset bound to a cluster (preset or spec)."""
    spec = load_cluster(cluster) if isinstance(cluster, str) else cluster
    return CostModel(file=analytic_cost_model(load_model(model), spec.hardware), cluster=spec)


def builtin_cost_model_files() -> list[CostModelFile]:
    """Every embedded cost model: analytic defaults for all model x hardware presets, then fitted."""
    analytic = [default_cost_model_file(m, h) for m in model_names() for h in hardware_names()]
    return analytic + fitted_cost_models()


def preset_records() -> dict[str, list[dict[str, Any]]]:
    """Every shipped preset, by kind (models, hardware, clusters, workloads, cost-models), as
    plain JSON-ready dicts: what ``dcp presets`` prints and ``GET /v1/presets`` answers."""
    return {
        "models": [load_model(n).model_dump(mode="json", exclude_none=True) for n in model_names()],
        "hardware": [load_hardware(n).model_dump(mode="json") for n in hardware_names()],
        "clusters": [load_cluster(n).model_dump(mode="json") for n in cluster_names()],
        "workloads": [load_workload_spec(n) for n in workload_names()],
        "cost-models": [{"id": f.id, "model": f.model.name, "hardware": f.hardware}
                        for f in builtin_cost_model_files()],
    }
