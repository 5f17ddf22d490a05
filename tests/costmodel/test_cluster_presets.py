"""Cluster presets by name: shipped ones, CPU worlds and a preset kind at another size."""

from __future__ import annotations

import pytest

from costmodel.presets import load_cluster


def test_a_preset_kind_at_another_size_keeps_its_hardware_and_nodes() -> None:
    base = load_cluster("h200x64")
    for gpus in (24, 48, 8 * 128):
        spec = load_cluster(f"h200x{gpus}")
        assert (spec.name, spec.num_gpus, spec.num_nodes) == (f"h200x{gpus}", gpus, gpus // 8)
        assert spec.hardware == base.hardware and spec.gpus_per_node == base.gpus_per_node


@pytest.mark.parametrize(("name", "reason"), [
    ("h200x12", "12 GPUs do not fill whole nodes of 8"),
    ("h100x4", "4 GPUs do not fill whole nodes of 8"),
    ("h200x0", "0 GPUs"),
    ("a100x8", "unknown cluster preset 'a100x8'"),
    ("h200xy", "unknown cluster preset 'h200xy'"),
])
def test_a_size_that_does_not_fit_is_refused_with_the_reason(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        load_cluster(name)
