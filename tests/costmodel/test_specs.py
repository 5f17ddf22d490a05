"""Wire schemas: round-trips and validation errors that name the field and value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from costmodel.presets import (
    cluster_names,
    load_cluster,
    load_hardware,
    load_model,
    load_workload_spec,
    model_names,
    workload_names,
)
from costmodel.specs import ClusterSpec, ModelSpec, Sample


def test_sample_1d_and_2d_round_trip() -> None:
    text = Sample(id="a", tokens=812)
    video = Sample(id="v", frames=15, height=22, width=40)
    assert video.tokens == 15 * 22 * 40
    assert video.shape_key == (15, 880)
    assert text.shape_key == (1, 812)
    for sample in (text, video):
        assert Sample.model_validate_json(sample.model_dump_json()) == sample


def test_negative_tokens_names_field_and_value() -> None:
    with pytest.raises(ValidationError) as info:
        Sample(id="bad", tokens=-5)
    err = info.value.errors()[0]
    assert err["loc"] == ("tokens",)
    assert err["input"] == -5
    assert isinstance(info.value, ValueError)


def test_2d_sample_needs_all_dims_and_consistent_tokens() -> None:
    with pytest.raises(ValueError, match="frames, height and width together"):
        Sample(id="x", frames=3, height=4)
    with pytest.raises(ValueError, match="tokens=10 does not equal"):
        Sample(id="x", frames=3, height=4, width=5, tokens=10)
    with pytest.raises(ValueError, match="height must be a positive integer, got 0"):
        Sample(id="x", frames=3, height=0, width=5)


def test_zero_gpus_rejected() -> None:
    with pytest.raises(ValidationError) as info:
        load_cluster("h200x8", num_gpus=0)
    assert info.value.errors()[0]["loc"] == ("num_gpus",)


def test_gpus_not_multiple_of_node_rejected() -> None:
    with pytest.raises(ValueError, match="num_gpus=12 is not a multiple of gpus_per_node=8"):
        load_cluster("h200x8", num_gpus=12)


def test_unknown_presets_rejected_with_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster preset 'h300x8'; known: .*h200x32"):
        load_cluster("h300x8")
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        load_model("gpt5")
    with pytest.raises(ValueError, match="unknown hardware preset"):
        load_hardware("tpu")
    with pytest.raises(ValueError, match="unknown workload preset"):
        load_workload_spec("nope")


def test_presets_ship_the_shared_specs() -> None:
    assert set(model_names()) >= {"llama-7b", "llama-13b", "stdit3-xl"}
    assert set(cluster_names()) >= {"h200x8", "h200x32", "h200x64", "h100x16"}
    assert set(workload_names()) == {
        "text-longcontext", "text-longtail", "video-balanced", "video-long", "video-short",
        "video3d-wan", "video3d-long", "text-millionctx", "video3d-longclip"}
    cluster = load_cluster("h200x32")
    assert cluster.num_nodes == 4
    assert cluster.hardware.hbm_bytes == 141e9
    assert ClusterSpec.model_validate_json(cluster.model_dump_json()) == cluster


def test_model_allowed_group_sizes_follow_heads() -> None:
    assert load_model("llama-7b").allowed_group_sizes(max_size=64) == [1, 2, 4, 8, 16, 32]
    assert load_model("stdit3-xl").allowed_group_sizes(max_size=8) == [1, 2, 4, 8]
    spec = ModelSpec(name="m24", kind="1d", num_layers=2, hidden=48, num_heads=24, ffn_hidden=96)
    assert spec.allowed_group_sizes(max_size=8) == [1, 2, 3, 4, 6, 8]


def test_model_spec_rejects_heads_not_dividing_hidden() -> None:
    with pytest.raises(ValueError, match="hidden=100 is not divisible by num_heads=3"):
        ModelSpec(name="m", kind="1d", num_layers=1, hidden=100, num_heads=3, ffn_hidden=10)


def test_shipped_presets_match_shared_workloads() -> None:
    import json
    from importlib import resources
    from pathlib import Path

    shared = Path(__file__).resolve().parents[3] / "shared" / "workloads"
    if not shared.is_dir():
        pytest.skip(f"{shared} not present")
    presets = resources.files("costmodel").joinpath("presets")
    for name in ("models.json", "hardware.json", "clusters.json"):
        shipped_items = json.loads(presets.joinpath(name).read_text())
        shared_items = json.loads((shared / name).read_text())
        # Every shared spec ships with each field as published; the presets add public models,
        # GPUs and clusters, and a model may name its architecture family (which real layer
        # class its activation bytes come from).
        assert set(shared_items) <= set(shipped_items), (name, set(shared_items) - set(shipped_items))
        for key, shared_spec in shared_items.items():
            extra = set(shipped_items[key]) - set(shared_spec)
            assert extra <= {"family"}, (name, key, extra)
            assert {f: shipped_items[key].get(f) for f in shared_spec} == shared_spec, (name, key)
    for path in shared.glob("*-*.json"):
        shipped = presets.joinpath("workloads", path.name).read_text()
        assert json.loads(shipped) == json.loads(path.read_text()), path.name
