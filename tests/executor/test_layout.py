"""Token placement: uneven pieces, index maps, subsets (single process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.layout import PackedLayout, SampleShape, piece_sizes


@given(tokens=st.integers(1, 200), d=st.integers(1, 8))
def test_pieces_cover_the_sample_evenly(tokens: int, d: int) -> None:
    pieces = piece_sizes(tokens, d)
    assert sum(pieces) == tokens and len(pieces) == d
    assert max(pieces) - min(pieces) <= 1


@settings(max_examples=60)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5), d=st.integers(1, 5))
def test_all_to_all_order_round_trips(lengths: list[int], d: int) -> None:
    """Simulate the all-to-all by hand: concatenating every rank's pieces rank-major and
    gathering gives each sample contiguous, in order; scattering inverts it."""
    samples = tuple(SampleShape(tokens=n) for n in lengths)
    layouts = [PackedLayout(samples=samples, group_size=d, index_in_group=r) for r in range(d)]
    full = torch.arange(sum(lengths))
    offsets = layouts[0].sample_offsets()
    local = [torch.cat([full[offsets[s]:offsets[s + 1]][slice(*lay.piece_range(s))]
                        for s in range(len(lengths))]) for lay in layouts]
    assert sum(x.numel() for x in local) == full.numel()
    rank_major = torch.cat(local)
    gathered = rank_major[layouts[0].gather_index()]
    assert torch.equal(gathered, full)
    assert torch.equal(full[layouts[0].scatter_index()], rank_major)
    for r, lay in enumerate(layouts):
        assert lay.local_tokens == local[r].numel()
        assert torch.equal(full[lay.local_positions() + torch.tensor(
            [offsets[s] for s in lay.local_sample_index().tolist()], dtype=torch.long)], local[r])


def test_subset_rows_select_the_pieces_of_those_samples() -> None:
    layout = PackedLayout(samples=(SampleShape(tokens=5), SampleShape(tokens=3), SampleShape(tokens=7)),
                          group_size=2, index_in_group=1)
    # rank 1 holds tokens 3-4 of sample 0, 2 of sample 1, 4-6 of sample 2: local rows 0-1, 2, 3-5
    assert layout.local_rows([2, 0]).tolist() == [3, 4, 5, 0, 1]
    sub = layout.subset([2, 0])
    assert sub.local_tokens == 5 and sub.samples[0].tokens == 7


def test_bad_shapes_are_rejected_with_the_values() -> None:
    with pytest.raises(ValueError, match="tokens=10 is not a positive multiple of frames=3"):
        SampleShape(tokens=10, frames=3)
    with pytest.raises(ValueError, match="index_in_group=2 outside group of 2"):
        PackedLayout(samples=(SampleShape(tokens=4),), group_size=2, index_in_group=2)
    layout = PackedLayout(samples=(SampleShape(tokens=4),), group_size=2, index_in_group=0)
    with pytest.raises(ValueError, match="sample 0: tensor has 3 rows, expected 4 tokens"):
        layout.shard(torch.zeros(3), 0)
