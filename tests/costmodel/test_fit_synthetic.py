"""costmodel.fit on synthetic profiles with known coefficients and noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from costmodel.collectives import collective_time_s
from costmodel.evaluate import CostModel
from costmodel.fit import FitConfig, FitRefusedError, fit_profiles, relative_nnls, split_indices
from costmodel.fit_terms import mape
from costmodel.presets import load_cluster, load_model
from costmodel.profiling.format import (
    CommRecord,
    ComputeRecord,
    HeadRecord,
    Profile,
    ProfileHeader,
    narrowed,
    read_profile,
    write_profile,
)
from costmodel.schema import CostModelFile
from costmodel.specs import ModelSpec, Sample

# Ground truth (seconds): forward/backward per layer call (tokens per rank, pairs, samples,
# call), the attention half-performance length (tokens per rank), the fixed cost.
FWD = {"tok": 2e-6, "pair": 1e-9, "sp": 3e-9, "tp": 5e-9, "sample": 1e-4, "layer": 5e-4}
BWD = {"tok": 4e-6, "pair": 2.5e-9, "sp": 7e-9, "tp": 1.1e-8, "sample": 2e-4, "layer": 8e-4}
HALF = 300.0
RELAYOUT_S = 1.5e-6  # per token per rank and pass, groups of 2 or more only (Ulysses re-layout)
FIXED_S = 2e-3
NONE_B, FULL_B, TRANSIENT_B = 9000.0, 512.0, 3000.0
LAYER_B = 4e6  # working bytes per layer whatever the tokens (weight-gradient buffers)
HEAD_S, HEAD_FIXED_S, HEAD_B = 3e-6, 1e-3, 20000.0
HEAD_TRANSIENT_B, HEAD_GRAD_B = 6000.0, 3e6  # the loss's backward per token; head weight gradients
ALPHA_S = 5e-5
# effective per-rank bandwidth of every measured configuration (group size, nodes): node-crossing
# groups are much slower, and not by any formula the fit knows
BW = {(2, 1): 2e9, (4, 1): 1.8e9, (16, 2): 0.4e9, (32, 4): 0.3e9}


def _layer_time(c: dict[str, float], samples: list[tuple[int, int]], kind: str, d: int = 1) -> float:
    """One call of one layer on one rank of a group of ``d`` (the form of costmodel.schema)."""
    t = c["layer"]
    for f, hw in samples:
        s = f * hw
        t += c["tok"] * s / d + c["sample"] + (RELAYOUT_S * s / d if d > 1 else 0.0)
        pairs = c["pair"] * s * s if kind == "1d" else c["sp"] * f * hw * hw + c["tp"] * hw * f * f
        t += pairs / d * (1 + HALF / (s / d))
    return t


def _timed(time_s: float) -> dict[str, float | int]:
    return {"time_s": time_s, "time_s_min": time_s * 0.99, "time_s_max": time_s * 1.02, "num_repeats": 5}


def _comm_time(op: str, nbytes: float, d: int, nodes: int) -> float:
    steps, share = (1, 1.0) if op == "alltoall" else (2 * (d - 1), 2.0)
    return ALPHA_S * steps + share * nbytes * (d - 1) / d / BW[d, nodes]


RECOMPUTED_B = {  # bytes per token one recomputed layer holds in its backward, by peak structure
    "on_top": NONE_B + TRANSIENT_B,  # the rematerialised layer on top of the transient (analytic form)
    "is_transient": NONE_B,  # the transient is the recomputed layer
    "heavier": 1.1 * NONE_B + TRANSIENT_B,  # recompute holds more than a plain layer (as on a CPU)
}


def true_peak(tokens_per_rank: float, n: int, k: int, structure: str) -> float:
    """The ground truth's peak of ``n`` layers, ``k`` checkpointed: the larger of the plain layers'
    backward (kept + transient) and a recomputed layer's (checkpointed inputs + the recomputed layer)."""
    plain = (n - k) * NONE_B + TRANSIENT_B if k < n else 0.0
    remat = RECOMPUTED_B[structure] if k > 0 else 0.0
    return tokens_per_rank * (k * FULL_B + max(plain, remat)) + n * LAYER_B


def synthetic_profile(model: ModelSpec, *, noise: float, seed: int = 0, profiled_layers: int = 2,
                      group_sizes: tuple[int, ...] = (1, 2, 4), structure: str = "on_top") -> Profile:
    """A compute+head+comm profile generated from the ground truth with relative noise (peaks of
    the given structure, ``RECOMPUTED_B``)."""
    rng = np.random.default_rng(seed)
    profiled = narrowed(model, num_layers=profiled_layers)
    singles: list[tuple[int, int]]
    if model.kind == "1d":
        singles = [(1, 64 * round(s / 64)) for s in np.geomspace(128, 16384, 10)]
    else:
        singles = [(f, hw) for f in (1, 4, 16, 64) for hw in (16, 64, 256, 1024)]
    batches = [[s] for s in singles] + [[singles[i], singles[-1 - i]] for i in range(4)] + \
        [[singles[i]] * 3 for i in range(3)]

    def noisy(value: float) -> float:
        return value * (1 + noise * rng.standard_normal())

    records: list[ComputeRecord | HeadRecord | CommRecord] = []
    for batch in batches:
        tokens = sum(f * hw for f, hw in batch)
        runs = [(n, k, 1) for n in (1, 2) for k in range(n + 1)] + [(2, 0, d) for d in group_sizes if d > 1]
        for n, k, d in runs:
            fwd = _layer_time(FWD, batch, model.kind, d)
            t = (n + k) * fwd + n * _layer_time(BWD, batch, model.kind, d) + FIXED_S
            kept = tokens / d * ((n - k) * NONE_B + k * FULL_B)
            peak = true_peak(tokens / d, n, k, structure)
            records.append(ComputeRecord(
                num_layers=n, recompute_layers=k, samples=batch, group_size=d, tokens_per_rank=tokens // d,
                **_timed(noisy(t)), activation_bytes=kept, device_kept_bytes=kept,
                device_peak_bytes=noisy(peak)))
    for tokens in (256, 1024, 4096, 16384, 512, 2048):
        records.append(HeadRecord(tokens=tokens, **_timed(noisy(HEAD_S * tokens + HEAD_FIXED_S)),
                                  activation_bytes=HEAD_B * tokens,
                                  device_peak_bytes=noisy((HEAD_B + HEAD_TRANSIENT_B) * tokens + HEAD_GRAD_B)))
    for op in ("alltoall", "allreduce"):
        for d, nodes in BW:
            for nbytes in np.geomspace(1e5, 1e8, 6):
                records.append(CommRecord(op=op, group_size=d, num_nodes=nodes, bytes_per_rank=float(nbytes),
                                          **_timed(noisy(_comm_time(op, float(nbytes), d, nodes)))))
    header = ProfileHeader(hardware="h200-sxm", device="cuda", dtype="bfloat16", model=model,
                           profiled=profiled)
    return Profile(
        header=header,
        compute=[r for r in records if isinstance(r, ComputeRecord)],
        head=[r for r in records if isinstance(r, HeadRecord)],
        comm=[r for r in records if isinstance(r, CommRecord)],
    )


@pytest.mark.parametrize("model_name", ["llama-7b", "stdit3-xl"])
def test_fit_recovers_known_coefficients(model_name: str) -> None:
    model = load_model(model_name)
    f = fit_profiles([synthetic_profile(model, noise=0.0)]).file
    assert f.provenance == "fitted"
    assert f.model == model
    fwd, bwd = f.compute.forward, f.compute.backward
    pairs = [("pair", "per_attn_pair")] if model.kind == "1d" else [
        ("sp", "per_spatial_pair"), ("tp", "per_temporal_pair")]
    for truth, fitted in ((FWD, fwd), (BWD, bwd)):
        assert fitted.per_token == pytest.approx(truth["tok"], rel=1e-3)
        assert fitted.per_sample == pytest.approx(truth["sample"], rel=1e-3)
        # per-call costs are per layer call; the micro-batch's fixed parts stay out of them
        assert fitted.per_call == pytest.approx(truth["layer"], rel=1e-3)
        assert fitted.per_token_relayout == pytest.approx(RELAYOUT_S, rel=1e-3)
        for key, attr in pairs:
            assert getattr(fitted, attr) == pytest.approx(truth[key], rel=1e-3)
    assert f.compute.attention_half_tokens == pytest.approx(HALF, rel=1e-3)
    assert f.compute.linear_half_tokens == 0.0  # not identifiable apart from per_call (noted)
    assert f.compute.microbatch_overhead_s == pytest.approx(FIXED_S + HEAD_FIXED_S, rel=1e-3)
    assert f.compute.head_s_per_token == pytest.approx(HEAD_S, rel=1e-3)
    assert f.activation.bytes_per_token_layer_none == pytest.approx(NONE_B, rel=1e-9)
    assert f.activation.bytes_per_token_layer_full == pytest.approx(FULL_B, rel=1e-9)
    assert f.activation.transient_bytes_per_token == pytest.approx(TRANSIENT_B, rel=1e-6)
    # the profiled layers have the model's width: the per-layer bytes are not rescaled
    assert f.activation.fixed_working_bytes_per_layer == pytest.approx(LAYER_B, rel=1e-6)
    assert f.activation.head_transient_bytes_per_token == pytest.approx(HEAD_TRANSIENT_B, rel=1e-6)
    for fit in (*f.comm.alltoall, *f.comm.allreduce):
        assert fit.group_size is not None and fit.num_nodes is not None
        assert fit.placement == ("intra" if fit.num_nodes == 1 else "inter")
        assert fit.bytes_per_s == pytest.approx(BW[fit.group_size, fit.num_nodes], rel=1e-6)
        assert fit.alpha_s == pytest.approx(ALPHA_S, rel=1e-6)


@pytest.mark.parametrize("model_name", ["llama-7b", "stdit3-xl"])
def test_noisy_fit_is_accurate_on_held_out_points(model_name: str) -> None:
    f = fit_profiles([synthetic_profile(load_model(model_name), noise=0.01)]).file
    assert f.compute.attention_half_tokens == pytest.approx(HALF, rel=0.15)
    for name in ("compute_time", "activation_bytes", "peak_bytes", "head_time", "alltoall", "allreduce"):
        assert f.fit_quality[name].mape < 0.03, name
        assert f.fit_quality[name].num_heldout >= 1


@pytest.mark.parametrize(("model_name", "structure"),
                         [("llama-7b", "on_top"), ("stdit3-xl", "is_transient"), ("llama-7b", "heavier")])
def test_every_term_reproduces_its_own_records_through_the_evaluator(model_name: str, structure: str) -> None:
    """Each fitted term, evaluated by costmodel.evaluate (not by the fit's design matrix), on the
    records it was fitted on, at every group size and node count, is as accurate as its reported
    held-out error says (the peaks of each plausible structure too)."""
    model = load_model(model_name)
    profile = synthetic_profile(model, noise=0.02, seed=3, structure=structure)
    result = fit_profiles([profile])
    f = result.file
    cluster = load_cluster("h200x64")

    def within(name: str, measured: list[float], predicted: list[float]) -> None:
        in_sample = mape(np.array(measured), np.array(predicted))
        assert in_sample <= 1.25 * f.fit_quality[name].mape + 0.002, (name, in_sample)

    # compute: the file with the stack's depth, no all-to-all, no head; fixed = the record's
    measured, predicted = [], []
    for rec in profile.compute:
        shallow = f.model_copy(update={
            "model": model.model_copy(update={"num_layers": rec.num_layers}),
            "comm": f.comm.model_copy(update={"alltoall_bytes_per_token_layer": 0.0,
                                              "alltoall_ops_per_layer": 0}),
            "compute": f.compute.model_copy(update={"head_s_per_token": 0.0,
                                                    "microbatch_overhead_s": result.compute_fixed_s})})
        cm = CostModel(file=shallow, cluster=cluster)
        samples = [Sample(id=f"s{i}", tokens=fr * hw, **({"frames": fr, "height": 1, "width": hw}
                                                          if model.kind == "2d" else {}))
                   for i, (fr, hw) in enumerate(rec.samples)]
        measured.append(rec.time_s)
        predicted.append(cm.microbatch_time_s(samples, group_size=rec.group_size,
                                              recompute_layers=[rec.recompute_layers] * len(samples)))
    within("compute_time", measured, predicted)
    # collectives: every measured (group size, nodes), the 16- and 32-rank node-crossing ones too
    for op in ("alltoall", "allreduce"):
        recs = [r for r in profile.comm if r.op == op]
        assert {(r.group_size, r.num_nodes) for r in recs} == set(BW)
        within(op, [r.time_s for r in recs],
               [float(collective_time_s(f.comm, op, r.bytes_per_rank, group_size=r.group_size,  # type: ignore[arg-type]
                                        num_nodes=r.num_nodes)) for r in recs])
    # peak memory: activation_bytes of the stack's depth without the head's working bytes (the
    # layer records ran no head)
    measured, predicted = [], []
    for rec in profile.compute:
        assert rec.device_peak_bytes is not None
        shallow = f.model_copy(update={
            "model": model.model_copy(update={"num_layers": rec.num_layers}),
            "activation": f.activation.model_copy(update={"working_bytes_per_token": 0.0,
                                                          "head_transient_bytes_per_token": 0.0})})
        cm = CostModel(file=shallow, cluster=cluster)
        measured.append(rec.device_peak_bytes)
        predicted.append(float(cm.activation_bytes(rec.num_tokens, group_size=rec.group_size,
                                                    recompute_layers=rec.recompute_layers))
                         + cm.fixed_working_bytes() - f.activation.fixed_working_bytes)
    within("peak_bytes", measured, predicted)


def test_old_profiles_read_as_group_size_one_and_need_a_fixed_attention_knee(tmp_path: Path) -> None:
    model = load_model("llama-7b")
    profile = synthetic_profile(model, noise=0.0, group_sizes=(1,))
    path = tmp_path / "v1.jsonl"
    header = profile.header.model_dump(mode="json") | {"format": "dcp-profile/1"}
    lines = [json.dumps(header)]
    for rec in [*profile.compute, *profile.head, *profile.comm]:
        data = rec.model_dump(mode="json")
        if data["record"] == "compute":  # version 1 had no group size on compute records
            data.pop("group_size")
            data.pop("tokens_per_rank")
        lines.append(json.dumps(data))
    path.write_text("\n".join(lines) + "\n")
    old = read_profile(path)
    assert {r.group_size for r in old.compute} == {1}
    assert all(r.tokens_per_rank == r.num_tokens for r in old.compute)
    with pytest.raises(ValueError, match="attention_half_tokens cannot be identified.*--group-sizes"):
        fit_profiles([old])
    fixed = fit_profiles([old], FitConfig(attention_half_tokens=HALF)).file
    assert fixed.compute.attention_half_tokens == HALF
    assert "fixed by the caller" in fixed.notes
    # a version-2 file must carry the new fields
    bad = tmp_path / "v2.jsonl"
    bad.write_text("\n".join([json.dumps(header | {"format": "dcp-profile/2"}), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"dcp-profile/2.*group_size"):
        read_profile(bad)


def test_fitted_file_predicts_full_model_through_cost_model(tmp_path: Path) -> None:
    model = load_model("llama-7b")
    file = fit_profiles([synthetic_profile(model, noise=0.005)]).file
    path = tmp_path / "cm.json"
    file.save(path)
    loaded = CostModelFile.load(path)
    assert loaded == file and loaded.digest() == file.digest()
    cm = CostModel(file=loaded, cluster=load_cluster("h200x8"))
    layers = model.num_layers
    for s in (512, 4096, 32768):
        for d in (1, 2, 4):
            for k in (0, layers // 2, layers):
                fwd = _layer_time(FWD, [(1, s)], "1d", d)
                bwd = _layer_time(BWD, [(1, s)], "1d", d)
                truth = layers * (fwd + bwd) + k * fwd + HEAD_S * s / d + FIXED_S + HEAD_FIXED_S
                sample = Sample(id="s", tokens=s)
                # the compute part of the prediction (no all-to-all) at group size d
                no_comm = cm.file.model_copy(update={"comm": cm.file.comm.model_copy(
                    update={"alltoall_bytes_per_token_layer": 0.0, "alltoall_ops_per_layer": 0})})
                compute_only = CostModel(file=no_comm, cluster=cm.cluster)
                predicted = compute_only.microbatch_time_s([sample], group_size=d, recompute_layers=[k])
                assert predicted == pytest.approx(truth, rel=0.03)
                mem = float(cm.activation_bytes(s, group_size=d, recompute_layers=k))
                assert mem > s / d * ((layers - k) * NONE_B + k * FULL_B + TRANSIENT_B)


def test_noisy_profile_is_refused_unless_forced() -> None:
    model = load_model("llama-7b")
    profile = synthetic_profile(model, noise=0.3, seed=1)
    with pytest.raises(FitRefusedError, match="compute_time"):
        fit_profiles([profile])
    forced = fit_profiles([profile], FitConfig(force=True)).file
    assert forced.fit_quality["compute_time"].mape > 0.10
    assert "FORCED" in forced.notes


def test_narrow_profile_is_scaled_to_the_full_width() -> None:
    model = load_model("llama-7b")
    base = synthetic_profile(model, noise=0.0)
    narrow = narrowed(model, num_layers=2, hidden=1024, num_heads=8, ffn_hidden=2752, vocab=4000)
    header = base.header.model_copy(update={"profiled": narrow})
    scaled = fit_profiles([base.model_copy(update={"header": header})]).file
    same = fit_profiles([base]).file
    assert scaled.compute.forward.per_token > 10 * same.compute.forward.per_token
    assert scaled.compute.forward.per_attn_pair == pytest.approx(4 * same.compute.forward.per_attn_pair,
                                                                  rel=1e-6)
    assert scaled.activation.bytes_per_token_layer_full == pytest.approx(
        4 * same.activation.bytes_per_token_layer_full, rel=1e-6)
    assert "scaled to the full width" in scaled.notes


def test_profile_and_cost_model_round_trip(tmp_path: Path) -> None:
    profile = synthetic_profile(load_model("stdit3-xl"), noise=0.01)
    path = tmp_path / "p.jsonl"
    write_profile(path, profile.header, [*profile.compute, *profile.head, *profile.comm])
    again = read_profile(path)
    assert again == profile
    a, b = fit_profiles([profile]).file, fit_profiles([again]).file
    assert a.digest() == b.digest()


@pytest.mark.parametrize(
    ("drop", "reason"),
    [
        ("checkpointed", "with and without checkpointed layers"),
        ("compute", "no compute records"),
        ("head_points", "too few points for head_time"),
        ("comm_points", "too few points for alltoall"),
        ("packing", "too few distinct points for compute_time"),
    ],
)
def test_insufficient_profile_is_refused_with_reason(drop: str, reason: str) -> None:
    p = synthetic_profile(load_model("llama-7b"), noise=0.01)
    if drop == "checkpointed":
        p = p.model_copy(update={"compute": [r for r in p.compute if r.recompute_layers == 0]})
    elif drop == "compute":
        p = p.model_copy(update={"compute": []})
    elif drop == "head_points":
        p = p.model_copy(update={"head": p.head[:2]})
    elif drop == "comm_points":
        p = p.model_copy(update={"comm": [r for r in p.comm if r.op != "alltoall" or r.bytes_per_rank < 2e5]})
    elif drop == "packing":  # one sample per micro-batch: per-sample and per-layer costs coincide
        p = p.model_copy(update={"compute": [r for r in p.compute if len(r.samples) == 1]})
    with pytest.raises(ValueError, match=reason):
        fit_profiles([p])


def test_relative_nnls_and_split() -> None:
    a = np.array([[1.0, 1.0], [1.0, 10.0], [1.0, 100.0], [1.0, 1000.0]])
    y = a @ np.array([2.0, 0.5])
    assert relative_nnls(a, y) == pytest.approx([2.0, 0.5], rel=1e-9)
    with pytest.raises(ValueError, match="positive"):
        relative_nnls(a, -y)
    train, held = split_indices(10, fraction=0.25, min_train=3, seed=0, term="t")
    assert len(held) >= 1 and len(train) >= 3
    assert sorted([*train, *held]) == list(range(10))
    with pytest.raises(ValueError, match="too few points for t"):
        split_indices(3, fraction=0.25, min_train=3, seed=0, term="t")


def test_fit_config_validates() -> None:
    with pytest.raises(ValueError, match="holdout_fraction"):
        FitConfig(holdout_fraction=1.5)
    with pytest.raises(ValueError, match="max_mape"):
        FitConfig(max_mape=0)


@pytest.mark.timeout(60)
def test_fit_does_not_import_torch() -> None:
    code = ("import sys, costmodel.fit, costmodel.profiling.format, dcp_cli.main; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_in_layer_alltoall_records_set_the_latency_of_their_group() -> None:
    """A group with ``in_layer`` all-to-all records (what a call adds inside the layers) takes its
    latency from them and its bandwidth from its back-to-back records; a group with in-layer
    records only takes both from them; other groups keep the back-to-back fit."""
    model = load_model("llama-7b")
    profile = synthetic_profile(model, noise=0.0)
    in_alpha_s, in_bw = 4 * ALPHA_S, BW[4, 1] / 3  # exposed calls cost more than back to back

    def in_layer(d: int, bw: float) -> list[CommRecord]:
        return [CommRecord(op="alltoall", group_size=d, num_nodes=1, bytes_per_rank=float(b), context="in_layer",
                           **_timed(in_alpha_s + float(b) * (d - 1) / d / bw)) for b in np.geomspace(1e5, 1e8, 6)]

    comm = [r for r in profile.comm if not (r.op == "alltoall" and r.group_size == 4)]
    comm += in_layer(2, BW[2, 1]) + in_layer(4, in_bw)
    f = fit_profiles([profile.model_copy(update={"comm": comm})]).file
    two = f.comm.exact_link("alltoall", group_size=2, num_nodes=1)
    four = f.comm.exact_link("alltoall", group_size=4, num_nodes=1)
    sixteen = f.comm.exact_link("alltoall", group_size=16, num_nodes=2)
    assert two is not None and four is not None and sixteen is not None
    assert (two.alpha_s, two.bytes_per_s) == (pytest.approx(in_alpha_s, rel=1e-3), pytest.approx(BW[2, 1], rel=1e-3))
    assert (four.alpha_s, four.bytes_per_s) == (pytest.approx(in_alpha_s, rel=1e-3), pytest.approx(in_bw, rel=1e-3))
    assert sixteen.alpha_s == pytest.approx(ALPHA_S, rel=1e-3)
    assert "latency fitted to in-layer records" in f.notes
    # without them the same profile fits the back-to-back link
    plain = fit_profiles([profile]).file.comm.exact_link("alltoall", group_size=2, num_nodes=1)
    assert plain is not None and plain.alpha_s == pytest.approx(ALPHA_S, rel=1e-3)


@pytest.mark.parametrize("noise", [0.0, 0.01])
@pytest.mark.parametrize("structure", sorted(RECOMPUTED_B))
def test_every_plausible_peak_structure_fits_without_force(structure: str, noise: float) -> None:
    """The rematerialised layer on top of the transient, the transient being the recomputed layer,
    or a recomputed layer heavier than a plain one: each fits unforced, and the full model's
    peaks (32 layers, every policy: depths the profile never ran) follow the ground truth."""
    model = load_model("llama-7b")
    result = fit_profiles([synthetic_profile(model, noise=noise, seed=5, structure=structure)])
    f = result.file
    peak = result.terms["peak_bytes"]
    assert peak.mape <= (1e-9 if noise == 0 else 0.05), peak.mape
    act = f.activation
    if noise == 0:
        assert act.recomputed_layer_bytes_per_token == pytest.approx(RECOMPUTED_B[structure], rel=1e-6)
        assert act.transient_bytes_per_token == pytest.approx(TRANSIENT_B, rel=1e-6)
        assert act.fixed_working_bytes_per_layer == pytest.approx(LAYER_B, rel=1e-6)
    words = {"on_top": "on top of the transient", "is_transient": "the transient is the recomputed layer",
             "heavier": "beyond a plain layer and its transient"}[structure]
    assert words in f.notes
    layers = model.num_layers
    bare = f.model_copy(update={"activation": act.model_copy(update={
        "working_bytes_per_token": 0.0, "head_transient_bytes_per_token": 0.0})})
    cm = CostModel(file=bare, cluster=load_cluster("h200x8"))
    for s in (1024, 65536):
        for d in (1, 4):
            for k in (0, 1, layers // 2, layers - 1, layers):
                truth = true_peak(s / d, layers, k, structure) - layers * LAYER_B
                got = float(cm.activation_bytes(s, group_size=d, recompute_layers=k))
                assert got == pytest.approx(truth, rel=1e-6 if noise == 0 else 0.05), (s, d, k)


ATTN_B = 2.0  # bytes per token pair: peaks that hold an attention matrix, which the form has no term for


def _quadratic_peaks(profile: Profile) -> Profile:
    return profile.model_copy(update={"compute": [
        r.model_copy(update={"device_peak_bytes": r.device_peak_bytes + ATTN_B * r.tokens_per_rank ** 2})
        for r in profile.compute]})


def test_a_noise_free_structural_misfit_is_never_called_noise_and_a_forced_fit_keeps_one_margin() -> None:
    """Noise-free peaks with a term the form lacks (an attention matrix, quadratic in the tokens):
    refused as a model-form error that follows the tokens; forced, the held-out under-prediction
    is recorded once as the file's margin, the coefficients are not scaled, and the planner keeps
    the larger of the margin's share and its safety fraction free, not their sum."""
    from costmodel.fit_diagnosis import RecordFactors, diagnose
    from planner.costs import CostTable

    model = load_model("llama-7b")
    profile = _quadratic_peaks(synthetic_profile(model, noise=0.0, seed=3))
    with pytest.raises(FitRefusedError, match="peak_bytes") as refused:
        fit_profiles([profile])
    message = str(refused.value)
    assert "model-form error, not noise" in message and "tokens" in message, message
    assert "looks like noise" not in message
    forced = fit_profiles([profile], FitConfig(force=True))
    verdict = diagnose(forced.terms["peak_bytes"], RecordFactors.of_compute(profile.compute))
    assert verdict.kind == "model-form"
    margin = forced.file.activation.memory_margin_fraction
    assert margin == pytest.approx(forced.terms["peak_bytes"].worst_underprediction) and margin > 0.05
    unforced = fit_profiles([profile], FitConfig(max_mape=10.0)).file.activation  # the same fit, accepted
    assert unforced.memory_margin_fraction == 0.0
    assert forced.file.activation.model_copy(update={"memory_margin_fraction": 0.0}) == unforced
    cm = CostModel(file=forced.file, cluster=load_cluster("h200x8"))
    reserved = cm.reserved_budget_fraction(0.05)
    assert reserved == pytest.approx(max(0.05, margin / (1 + margin)))
    table = CostTable(cm, [Sample(id="s", tokens=4096)], sizes=[1], memory_safety_fraction=0.05)
    assert table.budget_bytes == pytest.approx(cm.activation_budget_bytes() * (1 - reserved))
    assert table.budget_bytes > cm.activation_budget_bytes() * (1 - 0.05) / (1 + margin)  # not stacked


def test_noise_is_called_noise() -> None:
    """Peaks of the right form with 30% noise: refused, and called noise."""
    profile = synthetic_profile(load_model("llama-7b"), noise=0.3, seed=2)
    with pytest.raises(FitRefusedError, match="peak_bytes") as refused:
        fit_profiles([profile])
    assert "peak_bytes: looks like noise" in str(refused.value), str(refused.value)


def _factors(num: int) -> tuple[np.ndarray, object]:
    from costmodel.fit_diagnosis import RecordFactors

    policies = ["none", "selective", "full"]
    return np.arange(num), RecordFactors(policy=[policies[i % 3] for i in range(num)],
                                         group_size=[(1, 2, 4)[(i // 3) % 3] for i in range(num)],
                                         depth=[1 + (i // 9) % 2 for i in range(num)],
                                         tokens=[float(128 * 2 ** (i % 7)) for i in range(num)])


def test_diagnosis_tells_structure_from_noise_on_residuals() -> None:
    """Residuals by hand: white noise is noise on every seed; noise-free residuals that follow
    the policy, the tokens, or vary smoothly along the tokens are structural, naming the factor."""
    from costmodel.fit_diagnosis import RecordFactors, diagnose
    from costmodel.fit_terms import TermResult

    index, factors = _factors(54)
    assert isinstance(factors, RecordFactors)

    def verdict(resid: np.ndarray) -> object:
        measured = np.full(len(resid), 100.0)
        return diagnose(TermResult("x", 0.2, 40, 14, measured[:14], measured[:14], tuple(range(14)),
                                   measured=measured, predicted=measured * (1 + resid)), factors)

    for seed in range(20):
        noisy = verdict(0.1 * np.random.default_rng(seed).standard_normal(len(index)))
        assert noisy.kind == "noise", (seed, noisy)  # type: ignore[attr-defined]
    by_policy = verdict(np.array([0.12 if p == "full" else -0.03 for p in factors.policy]))
    assert by_policy.kind == "model-form" and by_policy.factors[0][0] == "policy"  # type: ignore[attr-defined]
    assert "full +12.0%" in by_policy.describe()  # type: ignore[attr-defined]
    by_tokens = verdict(0.05 * np.log(np.asarray(factors.tokens)) - 0.3)
    assert by_tokens.kind == "model-form" and "tokens" in by_tokens.describe()  # type: ignore[attr-defined]
    wavy = verdict(0.1 * np.sin(np.log2(np.asarray(factors.tokens))))  # no linear or quadratic trend
    assert wavy.kind == "model-form", wavy
    few = diagnose(TermResult("x", 0.2, 3, 2, np.ones(2), np.ones(2), (0, 1), measured=np.ones(5),
                              predicted=np.ones(5)), factors)
    assert few.kind == "unknown"


def test_profiles_of_one_shape_under_two_names_fit_together() -> None:
    """Two compute profiles of the same shape (a config.json profiled from two folders) fit as one
    model; a profile of another width is refused naming the field."""
    model = load_model("llama-7b")
    whole = synthetic_profile(model, noise=0.0)
    half = len(whole.compute) // 2
    renamed = model.model_copy(update={"name": "checkpoint-500"})
    header = whole.header.model_copy(update={"model": renamed,
                                             "profiled": whole.header.profiled.model_copy(update={"name": "x"})})
    first = whole.model_copy(update={"compute": whole.compute[:half]})
    second = Profile(header=header, compute=whole.compute[half:])
    assert fit_profiles([first, second]).file.activation == fit_profiles([whole]).file.activation
    wider = header.model_copy(update={"model": renamed.model_copy(update={"hidden": 8192})})
    with pytest.raises(ValueError, match="disagree on model.*hidden 4096 != 8192"):
        fit_profiles([first, Profile(header=wider, compute=whole.compute[half:])])
