"""Ring attention's p2p links fitted to ``dcp profile-comm --ops p2p``, and one layer's ring cost
on a placed group (issue 25).

The ring's time and memory are defined once, in :mod:`costmodel.ring_time` (pure functions, no
cost model; the names are re-exported here); :class:`costmodel.evaluate.CostModel` prices ``u x r``
groups with them (``layout``), :func:`ring_layer_time_s` is its one layer on a group placed at a
rank. A p2p transfer costs ``alpha + bytes / bandwidth`` (:func:`p2p_time_s`, the one definition
:func:`fit_p2p`, in :mod:`costmodel.fit_comm`, fits and the time uses) with an intra-node and an inter-node link
(:class:`P2PLinks`): the ring crosses nodes when its group does (its Ulysses subgroups are
consecutive ranks and stay inside a node as long as ``u`` divides the node).
"""

from __future__ import annotations

from collections.abc import Sequence

from costmodel.evaluate import CostModel
from costmodel.fit_comm import fit_p2p
from costmodel.ring_time import (
    MERGE_BYTES_PER_CHANNEL,
    RingLayerTime,
    default_p2p_links,
    kv_bytes_per_token,
    p2p_time_s,
    ring_attention_time_s,
    ring_kv_buffer_bytes,
)
from costmodel.schema import P2PLinks

__all__ = ["MERGE_BYTES_PER_CHANNEL", "P2PLinks", "RingLayerTime", "default_p2p_links", "fit_p2p",
           "kv_bytes_per_token", "p2p_time_s", "ring_attention_time_s", "ring_kv_buffer_bytes",
           "ring_layer_time_s"]


def ring_layer_time_s(cost_model: CostModel, tokens: Sequence[int], *, ulysses_degree: int, ring_degree: int,
                      first_rank: int, links: P2PLinks | None = None) -> RingLayerTime:
    """One layer's attention and its communication on a ``u x r`` group placed at ``first_rank``
    (:meth:`CostModel.ring_layer_time` on :meth:`CostModel.place`; ``links`` default: the cost
    model's :attr:`CostModel.p2p_links`)."""
    layout = cost_model.place(first_rank=first_rank, group_size=ulysses_degree * ring_degree,
                              ring_degree=ring_degree)
    return cost_model.ring_layer_time(tokens, layout=layout, links=links)
