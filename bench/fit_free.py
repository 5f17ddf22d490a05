"""Benchmark: fits that need no forcing. Profiles generated from known structure, fitted unforced.

Run from the repository root::

    .venv/bin/python bench/fit_free.py --out bench/results/fit_free.json   # ~1-2 minutes on 2 cores

For llama-7b, stdit3-xl, llama-3.1-8b and wan2.1-14b (two layers at the model's width, as
``dcp profile`` profiles them) it generates a compute + head profile whose times come from the
analytic cost model on an H200 (``costmodel.evaluate.CostModel.microbatch_time_s`` of the stack)
and whose peaks have one of three plausible structures, with 0 or 1% noise:

* ``on_top``: the rematerialised layer on top of the transient (what the analytic form says);
* ``is_transient``: the transient is the recomputed layer (a checkpointed layer's backward holds
  its rematerialised activations and nothing more);
* ``heavier``: a recomputed layer holds 10% more than a plain one, on top of the transient.

The kept bytes per layer (plain and checkpointed) and the transient are the analytic model's; the
per-layer bytes are 16 MiB. Each profile is fitted with
``costmodel.fit.fit_profiles`` without ``force``; the table shows whether it was accepted, the
held-out peak MAPE (target <= 5%), the in-sample peak MAPE (the records it was fitted on), the
recomputed layer's bytes against the truth, the worst error of the full model's predicted peaks
against the ground truth at every policy (depths the profile never ran) and the diagnosis of the
peak residuals. A last profile adds an attention matrix to the peaks (quadratic in the tokens,
which the form has no term for): refused as a model-form error, and forced, its margin and what
the margin and the safety fraction cost in step time on a preset (``dcp_cli.fit_reserve``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.fit import FitConfig, FitRefusedError, fit_profiles
from costmodel.fit_diagnosis import RecordFactors, diagnose
from costmodel.fit_terms import mape
from costmodel.presets import load_cluster, load_hardware, load_model
from costmodel.profiling.format import ComputeRecord, HeadRecord, Profile, ProfileHeader, narrowed
from costmodel.schema import CostModelFile
from costmodel.specs import ModelSpec, Sample
from dcp_cli.fit_reserve import price_reserve

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama-7b", "stdit3-xl", "llama-3.1-8b", "wan2.1-14b")
STRUCTURES = ("on_top", "is_transient", "heavier")
NOISES = (0.0, 0.01)
PRICE_ON = [("llama-7b", "text-longtail", "h200x8"), ("stdit3-xl", "video-balanced", "h200x8"),
            ("wan2.1-14b", "video3d-wan", "h200x32"), ("wan2.1-14b", "video3d-wan", "h100x128")]
"""Model, workload and cluster presets a fitted file is priced on, the profile made on the
cluster's hardware (llama-3.1-8b: its only workload, text-millionctx, is priced by its own
benchmark)."""
TARGET_HELDOUT_PEAK_MAPE = 0.05
PER_LAYER_BYTES = 16 * 2**20
"""The ground truth's bytes per layer whatever the tokens (a layer's backward buffers)."""
ATTN_BYTES_PER_PAIR = 8.0
"""Bytes per token pair of the misfit profile's attention matrix (four heads' bf16 scores held
whole on a rank, as an attention without a fused kernel holds them)."""


def _samples(model: ModelSpec) -> list[list[tuple[int, int]]]:
    """Micro-batches of ``(frames, tokens per frame)``: singles over sizes, pairs, triples."""
    if model.kind == "1d":
        singles = [(1, 64 * round(s / 64)) for s in np.geomspace(1024, 65536, 8)]
    else:
        singles = [(f, hw) for f in (1, 4, 16) for hw in (256, 1024, 3600)]
    return [[s] for s in singles] + [[singles[i], singles[-1 - i]] for i in range(3)] + \
        [[singles[i]] * 3 for i in range(2)]


def _sample_objects(model: ModelSpec, batch: list[tuple[int, int]]) -> list[Sample]:
    if model.kind == "1d":
        return [Sample(id=f"s{i}", tokens=hw) for i, (_, hw) in enumerate(batch)]
    return [Sample(id=f"s{i}", tokens=f * hw, frames=f, height=1, width=hw) for i, (f, hw) in enumerate(batch)]


def truth(model: ModelSpec, structure: str) -> dict[str, float]:
    """The ground truth's bytes per token (per rank) and per layer."""
    a = analytic_cost_model(model, load_hardware("h200-sxm")).activation
    none = a.bytes_per_token_layer_none
    recomputed = {"on_top": none + a.transient_bytes_per_token, "is_transient": none,
                  "heavier": 1.1 * none + a.transient_bytes_per_token}[structure]
    return {"none": none, "full": a.bytes_per_token_layer_full, "transient": a.transient_bytes_per_token,
            "recomputed": recomputed, "per_layer": PER_LAYER_BYTES}


def true_peak(t: dict[str, float], tokens_per_rank: float, n: int, k: int) -> float:
    """Peak of ``n`` layers, ``k`` checkpointed: the larger of the plain layers' backward and a
    recomputed layer's, above the checkpointed inputs, plus the per-layer bytes."""
    plain = (n - k) * t["none"] + t["transient"] if k < n else 0.0
    remat = t["recomputed"] if k > 0 else 0.0
    return tokens_per_rank * (k * t["full"] + max(plain, remat)) + n * t["per_layer"]


def profile(model: ModelSpec, structure: str, *, noise: float, seed: int, quadratic: bool = False,
            cluster_name: str = "h200x8") -> Profile:
    """Compute and head records: analytic times on the cluster's hardware, peaks of ``structure``,
    relative noise."""
    rng = np.random.default_rng(seed)
    cluster = load_cluster(cluster_name)
    hardware = cluster.hardware
    base = analytic_cost_model(model, hardware)
    t = truth(model, structure)

    def noisy(value: float) -> float:
        return value * (1.0 + noise * rng.standard_normal())

    def timed(time_s: float) -> dict[str, float | int]:
        value = noisy(time_s)
        return {"time_s": value, "time_s_min": value * 0.99, "time_s_max": value * 1.02, "num_repeats": 5}

    stacks = {}
    for n in (1, 2):  # the stack of n layers: no head, no all-to-all, its fixed cost
        stacks[n] = CostModel(file=base.model_copy(update={
            "model": model.model_copy(update={"num_layers": n}),
            "comm": base.comm.model_copy(update={"alltoall_bytes_per_token_layer": 0.0, "alltoall_ops_per_layer": 0}),
            "compute": base.compute.model_copy(update={"head_s_per_token": 0.0})}), cluster=cluster)
    records: list[ComputeRecord | HeadRecord] = []
    sizes = [d for d in (1, 2, 4) if model.num_heads % d == 0]
    for batch in _samples(model):
        tokens = sum(f * hw for f, hw in batch)
        samples = _sample_objects(model, batch)
        runs = [(n, k, 1) for n in (1, 2) for k in range(n + 1)] + [(2, 0, d) for d in sizes if d > 1]
        for n, k, d in runs:
            time_s = stacks[n].microbatch_time_s(samples, group_size=d, recompute_layers=[k] * len(samples))
            kept = tokens / d * ((n - k) * t["none"] + k * t["full"])
            peak = true_peak(t, tokens / d, n, k) + (ATTN_BYTES_PER_PAIR * (tokens / d) ** 2 if quadratic else 0.0)
            records.append(ComputeRecord(num_layers=n, recompute_layers=k, samples=batch, group_size=d,
                                         tokens_per_rank=tokens // d, **timed(time_s), activation_bytes=kept,
                                         device_kept_bytes=kept, device_peak_bytes=noisy(peak)))
    a, c = base.activation, base.compute
    for tokens in (1024, 4096, 16384, 65536, 2048, 8192):
        records.append(HeadRecord(tokens=tokens, **timed(c.head_s_per_token * tokens + c.microbatch_overhead_s),
                                  activation_bytes=a.working_bytes_per_token * tokens,
                                  device_peak_bytes=noisy(a.working_bytes_per_token * tokens + 1e6)))
    header = ProfileHeader(hardware=hardware.name, device="cuda", dtype="bfloat16", model=model,
                           profiled=narrowed(model, num_layers=2), notes=f"bench/fit_free.py {structure}")
    return Profile(header=header, compute=[r for r in records if isinstance(r, ComputeRecord)],
                   head=[r for r in records if isinstance(r, HeadRecord)])


def full_depth_error(file: CostModelFile, model: ModelSpec, t: dict[str, float]) -> float:
    """Worst ``|predicted / true - 1|`` of the full model's layer peaks over tokens, group sizes
    and every policy (the head's bytes left out: the truth has none)."""
    bare = file.model_copy(update={"activation": file.activation.model_copy(update={
        "working_bytes_per_token": 0.0, "head_transient_bytes_per_token": 0.0})})
    cm = CostModel(file=bare, cluster=load_cluster("h200x8"))
    layers, worst = model.num_layers, 0.0
    for s in (4096, 131072):
        for d in (1, 2):
            for k in sorted({0, 1, layers // 2, layers - 1, layers}):
                want = true_peak(t, s / d, layers, k) - layers * t["per_layer"]
                got = float(cm.activation_bytes(s, group_size=d, recompute_layers=k))
                worst = max(worst, abs(got / want - 1.0))
    return worst


def run_case(name: str, structure: str, noise: float) -> dict[str, Any]:
    """Fit one generated profile unforced; its figures."""
    model = load_model(name)
    prof = profile(model, structure, noise=noise, seed=7)
    t = truth(model, structure)
    row: dict[str, Any] = {"model": name, "structure": structure, "noise": noise}
    try:
        result = fit_profiles([prof])
    except FitRefusedError as exc:
        return row | {"accepted": False, "refusal": str(exc)}
    peak = result.terms["peak_bytes"]
    act = result.file.activation
    return row | {
        "accepted": True,
        "mape": {n: term.mape for n, term in result.terms.items()},
        "heldout_peak_mape": peak.mape,
        "insample_peak_mape": mape(peak.measured, peak.predicted),
        "recomputed_over_truth": (act.recomputed_layer_bytes_per_token or 0.0) / t["recomputed"],
        "transient_over_truth": act.transient_bytes_per_token / t["transient"] if t["transient"] else None,
        "full_depth_peak_error_max": full_depth_error(result.file, model, t),
        "diagnosis": diagnose(peak, RecordFactors.of_compute(prof.compute)).kind,
        "margin": act.memory_margin_fraction,
    }


def misfit_case(name: str) -> dict[str, Any]:
    """The quadratic misfit: refused (with its diagnosis), then forced and priced."""
    model = load_model(name)
    prof = profile(model, "is_transient", noise=0.0, seed=7, quadratic=True)
    row: dict[str, Any] = {"model": name, "structure": "is_transient + attention matrix", "noise": 0.0}
    try:
        fit_profiles([prof])
        row["refused"] = False
    except FitRefusedError as exc:
        row |= {"refused": True, "refusal": str(exc)}
    forced = fit_profiles([prof], FitConfig(force=True))
    row["heldout_peak_mape"] = forced.terms["peak_bytes"].mape
    row["margin"] = forced.file.activation.memory_margin_fraction
    row["priced"] = price_reserve(forced.file, workload="text-longtail", cluster="h200x8", safety_fraction=0.05)
    return row


def main() -> None:
    """Run the benchmark and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out("fit_free"))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = [run_case(name, s, noise) for name in MODELS for s in STRUCTURES for noise in NOISES]
    priced = {}
    for name, workload, cluster in PRICE_ON:
        prof = profile(load_model(name), "is_transient", noise=0.01, seed=7, cluster_name=cluster)
        fitted = fit_profiles([prof]).file
        priced[f"{name} {workload}@{cluster}"] = price_reserve(fitted, workload=workload, cluster=cluster,
                                                               safety_fraction=0.05)
    misfit = misfit_case("llama-7b")
    print(f"{'model':<13}{'structure':<14}{'noise':>6} {'unforced':>9}{'held-out':>10}{'in-sample':>10}"
          f"{'recomp/true':>12}{'full-depth':>11}  diagnosis")
    for r in rows:
        if not r["accepted"]:
            print(f"{r['model']:<13}{r['structure']:<14}{r['noise']:>6.0%} {'REFUSED':>9}  {r['refusal'][:80]}")
            continue
        flag = "*" if r["heldout_peak_mape"] > TARGET_HELDOUT_PEAK_MAPE else " "
        print(f"{r['model']:<13}{r['structure']:<14}{r['noise']:>6.0%} {'fits':>9}{r['heldout_peak_mape']:>9.2%}{flag}"
              f"{r['insample_peak_mape']:>10.2%}{r['recomputed_over_truth']:>12.4f}"
              f"{r['full_depth_peak_error_max']:>11.2%}  {r['diagnosis']}")
    print("\nreserve on a preset (is_transient, 1% noise, unforced: margin 0, safety fraction 0.05):")
    for name, p in priced.items():
        print(f"  {name}: " + ", ".join(
            f"{k} {v:.4g} s" if v is not None else f"{k} refused" for k, v in p["step_time_s"].items()))
    mp = misfit["priced"]
    print(f"\nmisfit (peaks + an attention matrix, noise-free): refused={misfit['refused']}; forced: held-out "
          f"peak MAPE {misfit['heldout_peak_mape']:.1%}, margin {misfit['margin']:.1%}, reserve "
          f"{mp['reserved_fraction']:.3f}; step time on {mp['workload']} @ {mp['cluster']}: " + ", ".join(
              f"{k} {'refused' if v is None else f'{v:.4g} s'}" for k, v in mp["step_time_s"].items()))
    accepted = [r for r in rows if r["accepted"]]
    print(f"\n{len(accepted)}/{len(rows)} accepted unforced; worst held-out peak MAPE "
          f"{max(r['heldout_peak_mape'] for r in accepted):.2%} (target {TARGET_HELDOUT_PEAK_MAPE:.0%}); "
          f"{time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.2f}")
    payload = {"benchmark": "fit_free", "rows": rows, "priced": priced, "misfit": misfit,
               "target_heldout_peak_mape": TARGET_HELDOUT_PEAK_MAPE,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
               "wall_s": time.perf_counter() - start,
               "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), **payload}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
