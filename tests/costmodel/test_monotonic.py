"""Monotonicity properties of the cost model (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.presets import default_cost_model

LLAMA = default_cost_model("llama-7b", "h200x32")
STDIT = default_cost_model("stdit3-xl", "h200x32")
SIZES = [1, 2, 4, 8, 16, 32]
STDIT_SIZES = [1, 2, 4, 8, 16]

settings.register_profile("ci", max_examples=150, deadline=None)
settings.load_profile("ci")


@given(s=st.integers(1, 500_000), extra=st.integers(1, 100_000), d=st.sampled_from(SIZES),
       k=st.integers(0, 32))
def test_more_tokens_never_cost_less_1d(s: int, extra: int, d: int, k: int) -> None:
    assert LLAMA.sample_time_s(s + extra, group_size=d, recompute_layers=k) >= LLAMA.sample_time_s(
        s, group_size=d, recompute_layers=k)
    assert LLAMA.activation_bytes(s + extra, group_size=d, recompute_layers=k) >= LLAMA.activation_bytes(
        s, group_size=d, recompute_layers=k)


@given(f=st.integers(1, 120), hw=st.integers(1, 3600), df=st.integers(0, 50), dhw=st.integers(0, 500),
       d=st.sampled_from(STDIT_SIZES))
def test_more_tokens_never_cost_less_2d(f: int, hw: int, df: int, dhw: int, d: int) -> None:
    small = STDIT.sample_time_s(f * hw, group_size=d, frames=f, spatial=hw)
    big = STDIT.sample_time_s((f + df) * (hw + dhw), group_size=d, frames=f + df, spatial=hw + dhw)
    assert big >= small


@given(s=st.integers(1, 1_000_000), i=st.integers(0, len(SIZES) - 2), k=st.integers(0, 32))
def test_larger_group_never_needs_more_memory_per_gpu(s: int, i: int, k: int) -> None:
    small_group = LLAMA.activation_bytes(s, group_size=SIZES[i], recompute_layers=k)
    large_group = LLAMA.activation_bytes(s, group_size=SIZES[i + 1], recompute_layers=k)
    assert large_group <= small_group


@given(s=st.integers(1, 1_000_000), d=st.sampled_from(SIZES), k=st.integers(0, 31))
def test_more_recompute_never_needs_more_memory_and_costs_more_time(s: int, d: int, k: int) -> None:
    assert LLAMA.activation_bytes(s, group_size=d, recompute_layers=32) <= LLAMA.activation_bytes(
        s, group_size=d, recompute_layers=0)
    # each extra recomputed layer below the last frees memory and costs time; recomputing the
    # last one too keeps one more layer input and frees nothing (its activations come back
    # while nothing above it is left to free): full is dominated by selective-(L-1)
    if k + 1 < 32:
        assert LLAMA.activation_bytes(s, group_size=d, recompute_layers=k + 1) <= LLAMA.activation_bytes(
            s, group_size=d, recompute_layers=k)
    else:
        full_bytes = LLAMA.file.activation.bytes_per_token_layer_full
        assert float(LLAMA.activation_bytes(s, group_size=d, recompute_layers=32)) == pytest.approx(
            float(LLAMA.activation_bytes(s, group_size=d, recompute_layers=31)) + s / d * full_bytes)
    assert LLAMA.sample_time_s(s, group_size=d, recompute_layers=k + 1) >= LLAMA.sample_time_s(
        s, group_size=d, recompute_layers=k)
