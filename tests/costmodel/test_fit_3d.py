"""costmodel.fit on synthetic 3d profiles: records of a whole-clip-attention DiT block (Wan2.1-14B
narrowed to 2 layers) made from known coefficients, in the record format of 2d (samples as
``(frames, spatial)`` pairs), fitted and then checked on the records it saw and on clips it never
saw (other resolutions and durations, the full 40 layers), through ``costmodel.evaluate``."""

from __future__ import annotations

import numpy as np
import pytest

from costmodel.evaluate import CostModel
from costmodel.fit import fit_profiles
from costmodel.presets import load_cluster, load_model
from costmodel.profiling.format import (
    CommRecord,
    ComputeRecord,
    HeadRecord,
    Profile,
    ProfileHeader,
    narrowed,
)
from costmodel.specs import ModelSpec, Sample

# Ground truth (seconds) of one layer call: per token per rank, per (query, key) pair of the whole
# clip (s^2, s = frames x spatial), per sample (the text keys/values of cross-attention), per call.
FWD = {"tok": 3e-6, "pair": 1.2e-9, "sample": 2e-4, "layer": 6e-4}
BWD = {"tok": 6e-6, "pair": 3e-9, "sample": 4e-4, "layer": 9e-4}
HALF = 400.0  # attention half-performance length (tokens per rank)
RELAYOUT_S = 1e-6  # Ulysses re-layout per token per rank and pass (groups of 2 or more)
FIXED_S = 1.5e-3
NONE_B, FULL_B, TRANSIENT_B, LAYER_B = 12000.0, 640.0, 5000.0, 3e6
HEAD_S, HEAD_FIXED_S, HEAD_B, HEAD_TRANSIENT_B, HEAD_GRAD_B = 1e-7, 5e-4, 400.0, 200.0, 1e6
ALPHA_S, BW = 4e-5, {(2, 1): 2e9, (4, 1): 1.8e9}

# Latent clips after Wan's 4x8x8 VAE and 1x2x2 patches, small enough to profile on one device:
# images (1 frame) and clips of 2-11 latent frames at 64x64 to 320x480 pixels.
PROFILED = [(f, hw) for f in (1, 2, 5, 11) for hw in (16, 60, 144, 300)]  # hw a multiple of 4: whole tokens a rank
# Never profiled: 480p and 720p images, a 480p 81-frame clip (21 latent frames), 256p 33 frames.
UNSEEN = [(1, 30 * 52), (1, 45 * 80), (21, 30 * 52), (9, 16 * 28), (5, 45 * 80)]


def _layer_time(c: dict[str, float], samples: list[tuple[int, int]], d: int) -> float:
    """One call of one layer on one rank of a group of ``d``: the 3d form, whole-clip pairs."""
    t = c["layer"]
    for f, hw in samples:
        s = f * hw
        t += c["tok"] * s / d + c["sample"] + (RELAYOUT_S * s / d if d > 1 else 0.0)
        t += c["pair"] * s * s / d * (1 + HALF / (s / d))
    return t


def _stack_time(samples: list[tuple[int, int]], *, layers: int, recompute: int, d: int) -> float:
    """A micro-batch through ``layers`` layers, ``recompute`` of them checkpointed (run twice forward)."""
    return (layers + recompute) * _layer_time(FWD, samples, d) + layers * _layer_time(BWD, samples, d)


def _timed(time_s: float) -> dict[str, float | int]:
    return {"time_s": time_s, "time_s_min": time_s * 0.99, "time_s_max": time_s * 1.02, "num_repeats": 5}


def synthetic_3d_profile(model: ModelSpec, *, noise: float, seed: int = 0) -> Profile:
    """Compute, head and comm records of ``model`` narrowed to 2 layers, from the ground truth."""
    rng = np.random.default_rng(seed)

    def noisy(value: float) -> float:
        return value * (1 + noise * rng.standard_normal())

    batches = [[s] for s in PROFILED] + [[PROFILED[i], PROFILED[-1 - i]] for i in range(4)] + \
        [[PROFILED[i]] * 3 for i in range(0, 12, 4)]
    compute = []
    for batch in batches:
        tokens = sum(f * hw for f, hw in batch)
        for n, k, d in [*((m, j, 1) for m in (1, 2) for j in range(m + 1)), (2, 0, 2), (2, 0, 4)]:
            kept = tokens / d * ((n - k) * NONE_B + k * FULL_B)
            peak = tokens / d * (max(n - k, 1 if k else 0) * NONE_B + k * FULL_B + TRANSIENT_B) + n * LAYER_B
            compute.append(ComputeRecord(
                num_layers=n, recompute_layers=k, samples=batch, group_size=d, tokens_per_rank=tokens // d,
                **_timed(noisy(_stack_time(batch, layers=n, recompute=k, d=d) + FIXED_S)),
                activation_bytes=kept, device_kept_bytes=kept, device_peak_bytes=noisy(peak)))
    head = [HeadRecord(tokens=t, **_timed(noisy(HEAD_S * t + HEAD_FIXED_S)), activation_bytes=HEAD_B * t,
                       device_peak_bytes=noisy((HEAD_B + HEAD_TRANSIENT_B) * t + HEAD_GRAD_B))
            for t in (256, 1024, 4096, 16384, 512, 2048)]
    comm = [CommRecord(op=op, group_size=d, num_nodes=nodes, bytes_per_rank=float(b),
                       **_timed(noisy(ALPHA_S * (1 if op == "alltoall" else 2 * (d - 1))
                                      + (1.0 if op == "alltoall" else 2.0) * b * (d - 1) / d / BW[d, nodes])))
            for op in ("alltoall", "allreduce") for d, nodes in BW for b in np.geomspace(1e5, 1e8, 6)]
    header = ProfileHeader(hardware="h200-sxm", device="cuda", dtype="bfloat16", model=model,
                           profiled=narrowed(model, num_layers=2))
    return Profile(header=header, compute=compute, head=head, comm=comm)


def test_a_3d_fit_recovers_the_whole_clip_coefficients() -> None:
    model = load_model("wan2.1-14b")
    assert model.kind == "3d" and model.cross_attention_tokens == 512
    f = fit_profiles([synthetic_3d_profile(model, noise=0.0)]).file
    assert f.model == model
    for truth, fitted in ((FWD, f.compute.forward), (BWD, f.compute.backward)):
        # one pair term over the whole clip, none spatial or temporal (2d's form)
        assert fitted.per_attn_pair == pytest.approx(truth["pair"], rel=1e-3)
        assert fitted.per_spatial_pair == 0 and fitted.per_temporal_pair == 0
        assert fitted.per_token == pytest.approx(truth["tok"], rel=1e-3)
        assert fitted.per_sample == pytest.approx(truth["sample"], rel=1e-3)
        assert fitted.per_call == pytest.approx(truth["layer"], rel=1e-3)
        assert fitted.per_token_relayout == pytest.approx(RELAYOUT_S, rel=1e-3)
    assert f.compute.attention_half_tokens == pytest.approx(HALF, rel=1e-3)
    assert f.activation.bytes_per_token_layer_none == pytest.approx(NONE_B, rel=1e-9)
    assert f.activation.bytes_per_token_layer_full == pytest.approx(FULL_B, rel=1e-9)
    assert f.activation.transient_bytes_per_token == pytest.approx(TRANSIENT_B, rel=1e-6)
    # 40 query heads of 128, as many key/value heads: no replication term in the all-to-all
    assert f.comm.alltoall_kv_head_bytes_per_token_layer == 2 * 2 * 128


def test_a_noisy_3d_fit_predicts_its_records_and_clips_it_never_saw() -> None:
    model = load_model("wan2.1-14b")
    profile = synthetic_3d_profile(model, noise=0.01, seed=5)
    result = fit_profiles([profile])
    f = result.file
    for name in ("compute_time", "activation_bytes", "peak_bytes", "head_time"):
        assert f.fit_quality[name].mape < 0.03, (name, f.fit_quality[name].mape)
        assert f.fit_quality[name].num_heldout >= 1
    cluster = load_cluster("h200x64")

    def compute_only(layers: int, fixed_s: float) -> CostModel:
        """The fitted file at ``layers`` layers, without all-to-all and head: the compute records' scope."""
        return CostModel(file=f.model_copy(update={
            "model": model.model_copy(update={"num_layers": layers}),
            "comm": f.comm.model_copy(update={"alltoall_bytes_per_token_layer": 0.0,
                                              "alltoall_kv_head_bytes_per_token_layer": 0.0,
                                              "alltoall_ops_per_layer": 0}),
            "compute": f.compute.model_copy(update={"head_s_per_token": 0.0, "microbatch_overhead_s": fixed_s})}),
            cluster=cluster)

    def clip(i: int, f_hw: tuple[int, int]) -> Sample:
        return Sample(id=f"c{i}", tokens=f_hw[0] * f_hw[1], frames=f_hw[0], height=1, width=f_hw[1])

    # the records it was fitted on (their noise-free truth), through the evaluator
    errors = []
    for rec in profile.compute:
        cm = compute_only(rec.num_layers, result.compute_fixed_s)
        truth = _stack_time(rec.samples, layers=rec.num_layers, recompute=rec.recompute_layers,
                            d=rec.group_size) + FIXED_S
        predicted = cm.microbatch_time_s([clip(i, s) for i, s in enumerate(rec.samples)],
                                         group_size=rec.group_size,
                                         recompute_layers=[rec.recompute_layers] * len(rec.samples))
        errors.append(abs(predicted / truth - 1))
    assert float(np.mean(errors)) < 0.02
    # unseen clips (up to 32,760 tokens, 3x the largest profiled) at the full 40 layers
    layers = model.num_layers
    full = compute_only(layers, result.compute_fixed_s)
    for i, shape in enumerate(UNSEEN):
        for d, k in ((1, 0), (4, layers), (8, layers // 2)):
            truth = _stack_time([shape], layers=layers, recompute=k, d=d) + FIXED_S
            predicted = full.microbatch_time_s([clip(i, shape)], group_size=d, recompute_layers=[k])
            assert predicted == pytest.approx(truth, rel=0.03), (shape, d, k)
            kept = float(full.activation_bytes(shape[0] * shape[1], group_size=d, recompute_layers=k))
            assert kept > shape[0] * shape[1] / d * ((layers - k) * NONE_B + k * FULL_B)
    # a mixed micro-batch of an image and a clip is the sum of its samples over one fixed part
    pair = [clip(0, UNSEEN[0]), clip(1, UNSEEN[2])]
    truth = _stack_time([UNSEEN[0], UNSEEN[2]], layers=layers, recompute=0, d=8) + FIXED_S
    assert full.microbatch_time_s(pair, group_size=8, recompute_layers=[0, 0]) == pytest.approx(truth, rel=0.03)
