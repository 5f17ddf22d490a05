"""Workloads: seeded batches from the presets and JSON Lines manifests."""

from __future__ import annotations

import pytest

from costmodel.specs import Sample
from planner.workload import (
    LengthDistribution,
    WorkloadSpec,
    parse_manifest_lines,
    read_manifest,
    sample_batch,
    synthesize_manifest,
    write_manifest,
)

ALL = ["video-short", "video-balanced", "video-long", "text-longtail", "text-longcontext", "text-millionctx"]


@pytest.mark.parametrize("name", ALL)
def test_batches_are_reproducible_and_within_spec(name: str) -> None:
    spec = WorkloadSpec.preset(name)
    a = sample_batch(spec, num_samples=256, seed=7, step=3)
    b = sample_batch(spec, num_samples=256, seed=7, step=3)
    c = sample_batch(spec, num_samples=256, seed=7, step=4)
    assert a == b
    assert a != c
    assert len({s.id for s in a}) == 256
    if spec.kind == "2d":
        shapes = {(bk.frames, bk.height, bk.width) for bk in spec.buckets or []}
        assert all((s.frames, s.height, s.width) in shapes for s in a)
    else:
        dist = spec.distribution
        assert dist is not None
        assert all(dist.min_tokens <= s.tokens <= dist.max_tokens for s in a)
    assert max(s.tokens for s in a) <= spec.max_sample.tokens


def test_video_short_is_short_dominated() -> None:
    batch = sample_batch(WorkloadSpec.preset("video-short"), num_samples=2000, seed=0)
    single_frame = sum(1 for s in batch if s.frames == 1)
    assert single_frame / len(batch) > 0.7  # weights of the 1-frame buckets sum to ~0.78


def test_manifest_round_trip(tmp_path) -> None:
    samples = synthesize_manifest(WorkloadSpec.preset("video-balanced"), num_samples=50, seed=1)
    samples += [Sample(id="text-1", tokens=77)]
    path = tmp_path / "m.jsonl"
    write_manifest(samples, path)
    assert read_manifest(path) == samples


def test_manifest_errors_name_line_and_field() -> None:
    with pytest.raises(ValueError, match=r"m:2: tokens: .*greater than 0.*got a JSON integer"):
        list(parse_manifest_lines(['{"id": "a", "tokens": 5}', '{"id": "b", "tokens": -3}'], source="m"))
    with pytest.raises(ValueError, match="m:1: not JSON"):
        list(parse_manifest_lines(["{oops"], source="m"))
    with pytest.raises(ValueError, match="m:3: duplicate sample id 'a'"):
        list(parse_manifest_lines(['{"id": "a", "tokens": 5}', "", '{"id": "a", "tokens": 6}'], source="m"))


def test_numeric_ids_are_kept_as_strings() -> None:
    (sample,) = parse_manifest_lines(['{"id": 17, "frames": 1, "height": 9, "width": 16}'])
    assert sample.id == "17"
    assert sample.tokens == 144


def test_bad_batch_size_rejected() -> None:
    with pytest.raises(ValueError, match="num_samples must be positive, got 0"):
        sample_batch(WorkloadSpec.preset("video-short"), num_samples=0, seed=0)


def test_every_workload_preset_draws_samples_of_its_models_kind() -> None:
    from costmodel.presets import load_model, workload_names

    for name in workload_names():
        spec = WorkloadSpec.preset(name)
        model = load_model(spec.model)
        assert model.kind == spec.kind, name
        batch = sample_batch(spec, num_samples=64, seed=0)
        assert all((s.frames is None) == (spec.kind == "1d") for s in batch), name
        assert max(s.tokens for s in batch) <= spec.max_sample.tokens


def test_3d_presets_are_latents_of_public_resolutions() -> None:
    # 4x8x8 VAE and 1x2x2 patches: 720p (720 x 1280 px) is 45 x 80 patches, 81 frames 21 latent frames.
    spec = WorkloadSpec.preset("video3d-wan")
    shapes = {(b.frames, b.height, b.width) for b in spec.buckets or []}
    assert (21, 45, 80) in shapes and (1, 30, 52) in shapes and spec.max_sample.tokens == 21 * 45 * 80
    assert WorkloadSpec.preset("video3d-long").max_sample.tokens == 31 * 68 * 120  # 1080p, 121 frames


def test_millionctx_mixes_a_long_tail_with_256k_to_1m_documents() -> None:
    spec = WorkloadSpec.preset("text-millionctx")
    assert spec.model == "llama-3.1-8b" and spec.max_sample.tokens == 1 << 20
    tokens = [s.tokens for s in sample_batch(spec, num_samples=4000, seed=0)]
    long = [t for t in tokens if t >= 262144]
    # 5% long component: 200 expected, binomial sd ~14; the tail component stops at 131072.
    assert 150 <= len(long) <= 250, len(long)
    assert not [t for t in tokens if 131072 < t < 262144]
    assert max(long) <= 1 << 20 and sorted(tokens)[len(tokens) // 2] < 4096  # median of the tail


def test_a_mixture_draws_each_component_by_weight_and_keeps_plain_draws() -> None:
    tail = {"type": "loguniform", "min_tokens": 10, "max_tokens": 20}
    spec = WorkloadSpec.model_validate({
        "schema": "dcp-workload/1", "name": "mix", "kind": "1d", "model": "llama-7b",
        "distribution": {"type": "mixture", "min_tokens": 10, "max_tokens": 1000, "components": [
            {**tail, "weight": 3.0}, {"type": "loguniform", "min_tokens": 900, "max_tokens": 1000,
                                      "weight": 1.0}]}})
    tokens = [s.tokens for s in sample_batch(spec, num_samples=2000, seed=1)]
    assert all(10 <= t <= 20 or 900 <= t <= 1000 for t in tokens)
    assert 0.2 <= sum(t >= 900 for t in tokens) / len(tokens) <= 0.3  # weight 1 of 4
    plain = WorkloadSpec.model_validate({"schema": "dcp-workload/1", "name": "p", "kind": "1d",
                                         "model": "llama-7b", "distribution": tail})
    assert len({s.tokens for s in sample_batch(plain, num_samples=50, seed=1)}) > 1


@pytest.mark.parametrize(("dist", "message"), [
    ({"type": "mixture", "min_tokens": 1, "max_tokens": 9}, "a mixture distribution needs components"),
    ({"type": "loguniform", "min_tokens": 1, "max_tokens": 9,
      "components": [{"type": "loguniform", "min_tokens": 1, "max_tokens": 9, "weight": 1}]},
     "a loguniform distribution takes no components"),
    ({"type": "mixture", "min_tokens": 5, "max_tokens": 9,
      "components": [{"type": "loguniform", "min_tokens": 1, "max_tokens": 9, "weight": 1}]},
     r"mixture component \[1, 9\] lies outside the mixture's bounds \[5, 9\]"),
    ({"type": "mixture", "min_tokens": 1, "max_tokens": 9,
      "components": [{"type": "loguniform", "min_tokens": 1, "max_tokens": 9, "weight": 0}]},
     "mixture component weights sum to 0"),
])
def test_bad_mixtures_are_refused(dist: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LengthDistribution.model_validate(dist)


def test_longclip_is_long_wan_clips_past_its_heads() -> None:
    spec = WorkloadSpec.preset("video3d-longclip")
    assert spec.kind == "3d" and spec.model == "wan2.1-1.3b"
    sizes = sorted(b.frames * b.height * b.width for b in spec.buckets or [])
    assert sizes[0] == 13 * 30 * 52 and spec.max_sample.tokens == 41 * 45 * 80  # 480p x 49f, 720p x 161f
    assert all(b.frames > 1 for b in spec.buckets or [])  # clips only
    assert abs(sum(b.weight for b in spec.buckets or []) - 1) < 1e-5
