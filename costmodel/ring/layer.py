"""One layer's ring cost on a group placed at a rank of a cost model's cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from costmodel.ring.timing import RingLayerTime
from costmodel.schema import P2PLinks

if TYPE_CHECKING:  # the cost model imports this package: a type only
    from costmodel.evaluate import CostModel


def ring_layer_time_s(cost_model: CostModel, tokens: Sequence[int], *, ulysses_degree: int, ring_degree: int,
                      first_rank: int, links: P2PLinks | None = None, sliding: bool = False) -> RingLayerTime:
    """One layer's attention and its communication on a ``u x r`` group placed at ``first_rank``
    (:meth:`CostModel.ring_layer_time` on :meth:`CostModel.place`; ``links`` default: the cost
    model's :attr:`CostModel.p2p_links`; ``sliding``: one of the model's sliding-window layers)."""
    layout = cost_model.place(first_rank=first_rank, group_size=ulysses_degree * ring_degree,
                              ring_degree=ring_degree)
    return cost_model.ring_layer_time(tokens, layout=layout, links=links, sliding=sliding)
