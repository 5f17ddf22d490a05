"""Time of one collective: the single formula that ``costmodel.fit`` fits and every evaluation uses.

An operation on ``d`` ranks where each holds ``b`` bytes costs ``latency_steps * alpha +
wire_bytes(b) * seconds_per_byte``, with ``alpha`` and the bandwidth from the fitted (or
preset) links of :class:`costmodel.schema.CommCoefficients` (:func:`collective_cost`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.schema import CommCoefficients

FloatArray = NDArray[np.float64]


Collective = Literal["alltoall", "allreduce", "allgather", "reducescatter"]
"""``allgather`` (parameters: after a sharded optimizer step, FSDP2's per unit) and
``reducescatter`` (FSDP2's gradients) are timed with the all-reduce links."""


def latency_steps(op: Collective, group_size: int) -> float:
    """Latency terms of one operation: 1 for an all-to-all, ``2*(d-1)`` for a ring all-reduce,
    ``d-1`` for a ring all-gather or reduce-scatter."""
    if op == "alltoall":
        return 1.0
    return float(group_size - 1) * (2.0 if op == "allreduce" else 1.0)


def wire_bytes(op: Collective, bytes_per_rank: ArrayLike, group_size: int) -> FloatArray:
    """Bytes each rank sends in one operation on ``bytes_per_rank`` bytes: ``(d-1)/d`` of them for
    an all-to-all, an all-gather (of its output) and a reduce-scatter (of its input), twice that
    for a ring all-reduce."""
    share = (group_size - 1) / group_size * (2.0 if op == "allreduce" else 1.0)
    return np.asarray(np.asarray(bytes_per_rank, dtype=np.float64) * share, dtype=np.float64)


def collective_cost(comm: CommCoefficients, op: Collective, *, group_size: int, num_nodes: int
                    ) -> tuple[float, float]:
    """``(latency seconds, seconds per wire byte)`` of one operation.

    A fit measured for exactly this group size and node count is used as measured. Otherwise
    the time comes from raw links: inside a node the intra link; across ``n`` nodes an
    all-to-all keeps ``(d/n - 1)/(d - 1)`` of what it sends inside the node and sends the rest
    over the network, both in parallel (the slower sets the time); a ring is as slow as its
    network hop. A measured inter-node fit stands in for the raw network link scaled by its own
    network share (exact on the configuration it was measured on).
    """
    link_kind: Literal["alltoall", "allreduce"] = "alltoall" if op == "alltoall" else "allreduce"
    steps = latency_steps(op, group_size)
    exact = comm.exact_link(link_kind, group_size=group_size, num_nodes=num_nodes)
    if exact is not None:
        return exact.alpha_s * steps, 1.0 / exact.bytes_per_s
    intra = comm.link(link_kind, placement="intra", group_size=group_size)
    if num_nodes <= 1:
        return intra.alpha_s * steps, 1.0 / intra.bytes_per_s
    inter = comm.link(link_kind, placement="inter", group_size=group_size)
    net_bytes_per_s = inter.bytes_per_s
    if inter.group_size is not None:
        measured_nodes = inter.num_nodes or max(2, num_nodes)
        net_bytes_per_s *= _network_share(op, inter.group_size, measured_nodes)
    in_share = 1.0 if op != "alltoall" else (group_size / num_nodes - 1) / (group_size - 1)
    out_share = _network_share(op, group_size, num_nodes)
    per_byte = max(in_share / intra.bytes_per_s, out_share / net_bytes_per_s)
    return inter.alpha_s * steps, per_byte


def _network_share(op: Collective, group_size: int, num_nodes: int) -> float:
    """Share of the wire bytes that cross the network (all-to-all) or 1 (a ring's bottleneck)."""
    if op != "alltoall" or num_nodes <= 1:
        return 1.0 if num_nodes > 1 else 0.0
    return 1.0 - (group_size / num_nodes - 1) / (group_size - 1)


def collective_time_s(comm: CommCoefficients, op: Collective, bytes_per_rank: ArrayLike, *,
                      group_size: int, num_nodes: int) -> FloatArray:
    """Seconds of one operation where each rank holds ``bytes_per_rank`` bytes (0 for one rank).

    This is the single definition of a collective's time: ``costmodel.fit`` fits it and every
    evaluation uses it.
    """
    data = np.asarray(bytes_per_rank, dtype=np.float64)
    if group_size <= 1:
        return np.zeros_like(data)
    alpha, per_byte = collective_cost(comm, op, group_size=group_size, num_nodes=num_nodes)
    return np.asarray(alpha + wire_bytes(op, data, group_size) * per_byte, dtype=np.float64)
