"""What every part of :class:`costmodel.evaluate.CostModel` reads from the model it is part of."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from costmodel.schema import CostModelFile
    from costmodel.specs import ClusterSpec


class CostModelPart:
    """The base of ``CostModel``'s parts (its mixins: :class:`costmodel.memory_costs.MemoryCosts`,
    :class:`costmodel.ring.costs.RingCosts`): the file, the cluster and the layer count, which
    ``CostModel`` provides."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by CostModel
        file: CostModelFile
        cluster: ClusterSpec

        @property
        def num_layers(self) -> int: ...
