"""Cost of ring attention and of the Ulysses x ring hybrid (issue 25): time, p2p links, memory.

A group of ``d = u x r`` ranks (``executor/ring_layout.py``) swaps sequence for heads over its
``u`` ranks (the all-to-alls of a Ulysses group of ``u``) and passes key/value blocks around a
ring of ``r`` rank-sets. On one rank, per layer and pass, for a micro-batch of samples of ``s_i``
tokens:

* every ring step attends the rank's queries (``sum s_i / r`` tokens, ``H/u`` heads) to one
  key/value block; with the zig-zag chunks every step does the same share of the pairs, so a
  step computes ``sum s_i^2 / (u r^2)`` pairs at the cost model's ``per_attn_pair`` (the ``r``
  steps add up to the ``s^2/d`` a Ulysses group of ``d`` computes);
* a hop moves one block of ``sum s_i / r`` tokens' keys and values for this rank's key/value
  heads (``max(H_kv/u, 1)``: past ``H_kv`` Ulysses replicates a head, :mod:`costmodel.specs`);
  it is posted before the step's attention, so a step takes ``max(compute, hop)``; ``r - 1`` such
  steps, then the last block's compute alone, then ``r - 1`` log-sum-exp merges of the running
  output (read it, read the block's, write it: 3 x fp32 per query and head channel, at the HBM
  bandwidth). Backward sends keys and values and their gradients (twice the bytes) per step and
  the gradients' last hop home.

:func:`ring_layer_time_s` gives those per layer and pass; the part the ring adds to a compute
that the cost model already charges as ``s^2/d`` pairs is ``exposed_*`` (hops the compute does not
hide, plus merges). A p2p transfer costs ``alpha + bytes / bandwidth`` (:func:`p2p_time_s`, the one
definition :func:`fit_p2p` fits and the time uses) with an intra-node and an inter-node link
(:class:`P2PLinks`): the ring crosses nodes when its group does (its Ulysses subgroups are
consecutive ranks and stay inside a node as long as ``u`` divides the node).

Memory: the ring holds the block in hand and the one arriving (forward), keys, values and their
gradients of both (backward): :func:`ring_kv_buffer_bytes` per rank, transient on top of the
Ulysses working set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from scipy.optimize import nnls

from costmodel.collectives import collective_cost, wire_bytes
from costmodel.evaluate import CostModel, nodes_spanned
from costmodel.profiling.format import CommRecord
from costmodel.schema import LinkFit
from costmodel.specs import HardwareSpec, ModelSpec

MERGE_BYTES_PER_CHANNEL = 12.0
"""HBM bytes of one log-sum-exp merge per query and head channel: read the running fp32 output,
read the block's, write the result."""


class P2PLinks(BaseModel):
    """Point-to-point links of a ring hop: one inside a node, one across nodes (``LinkFit``s
    with ``group_size`` 2: a hop is one rank sending to the next)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    intra: LinkFit = Field(description="A hop between two GPUs of one node.")
    inter: LinkFit | None = Field(default=None, description="A hop between nodes (None: not measured).")

    def link(self, *, crosses_nodes: bool) -> LinkFit:
        """The link of a hop.

        Raises:
            ValueError: for a hop across nodes without an inter-node link.
        """
        if not crosses_nodes:
            return self.intra
        if self.inter is None:
            raise ValueError("a ring across nodes needs an inter-node p2p link; profile it "
                             "(dcp profile-comm --ops p2p on two nodes, or --gpus-per-node to emulate)")
        return self.inter


def p2p_time_s(links: P2PLinks, bytes_per_hop: float | np.ndarray, *, crosses_nodes: bool) -> np.ndarray:
    """Seconds of one hop of ``bytes_per_hop`` bytes: ``alpha + bytes / bandwidth``."""
    link = links.link(crosses_nodes=crosses_nodes)
    return np.asarray(link.alpha_s + np.asarray(bytes_per_hop, dtype=np.float64) / link.bytes_per_s)


def default_p2p_links(hardware: HardwareSpec, *, alpha_intra_s: float = 10e-6,
                      alpha_inter_s: float = 20e-6) -> P2PLinks:
    """Unfitted links from the hardware's public bandwidths (NVLink per direction inside a node,
    the per-GPU network across nodes); the latencies are placeholders of the order NCCL's p2p
    has, to be replaced by :func:`fit_p2p` on ``dcp profile-comm`` records."""
    return P2PLinks(
        intra=LinkFit(placement="intra", group_size=2, num_nodes=1, alpha_s=alpha_intra_s,
                      bytes_per_s=hardware.nvlink_bytes_per_s_per_direction),
        inter=LinkFit(placement="inter", group_size=2, num_nodes=2, alpha_s=alpha_inter_s,
                      bytes_per_s=hardware.network_bytes_per_s_per_gpu))


def fit_p2p(records: Sequence[CommRecord]) -> tuple[P2PLinks, dict[str, float]]:
    """Fit ``alpha + bytes / bandwidth`` per placement to the ``p2p`` records (least squares,
    relative errors, non-negative latency) and report each placement's MAPE on those records.

    Raises:
        ValueError: without intra-node p2p records of at least two message sizes.
    """
    fits: dict[str, LinkFit] = {}
    errors: dict[str, float] = {}
    for placement in ("intra", "inter"):
        recs = [r for r in records if r.op == "p2p" and r.placement == placement]
        if len({r.bytes_per_rank for r in recs}) < 2:
            continue
        x = np.array([r.bytes_per_rank for r in recs])
        y = np.array([r.time_s for r in recs])
        # relative least squares, both terms non-negative; a slope of 0 (times that do not grow
        # with the size, e.g. on a loaded CPU) leaves the bandwidth at its 1e30 B/s floor
        coef, _ = nnls(np.stack([np.ones_like(x), x], axis=1) / y[:, None], np.ones_like(y))
        alpha, per_byte = float(coef[0]), max(float(coef[1]), 1e-30)
        fits[placement] = LinkFit(placement=placement, group_size=2, num_nodes=1 if placement == "intra" else 2,  # type: ignore[arg-type]
                                  alpha_s=alpha, bytes_per_s=1.0 / per_byte)
        errors[placement] = float(np.mean(np.abs(alpha + x * per_byte - y) / y))
    if "intra" not in fits:
        raise ValueError(f"fitting p2p links needs intra-node p2p records of two or more sizes; got "
                         f"{sum(r.op == 'p2p' for r in records)} p2p records")
    return P2PLinks(intra=fits["intra"], inter=fits.get("inter")), errors


def kv_bytes_per_token(model: ModelSpec, *, ulysses_degree: int, element_bytes: float = 2.0) -> float:
    """Bytes of one token's keys and values for the key/value heads a rank holds after the Ulysses
    swap over ``u`` ranks (``H_kv / u``, at least one replicated head past ``H_kv``)."""
    heads = max(model.kv_heads / ulysses_degree, 1.0)
    return 2.0 * heads * model.head_size * element_bytes


@dataclass(kw_only=True, frozen=True, slots=True)
class RingLayerTime:
    """One layer's attention on one rank of a ``u x r`` group, per pass."""

    forward_s: float
    """Ring attention of the forward: steps of ``max(compute, hop)``, the last block, the merges."""
    backward_s: float
    """Its backward: steps of ``max(compute, 2 hops' bytes)``, the last block, the gradients' hop home."""
    exposed_forward_s: float
    """What the forward ring adds to its ``s^2/d`` pairs of compute (unhidden hops and merges)."""
    exposed_backward_s: float
    """What the backward ring adds to its compute."""
    alltoall_forward_s: float
    """The Ulysses all-to-alls over ``u`` of one pass (forward; backward moves the same)."""


def ring_attention_time_s(tokens: Sequence[int], *, ulysses_degree: int, ring_degree: int,
                          forward_s_per_pair: float, backward_s_per_pair: float, kv_bytes_per_token: float,
                          query_channels: int, links: P2PLinks, crosses_nodes: bool,
                          hbm_bytes_per_s: float) -> tuple[float, float, float, float]:
    """``(forward, backward, exposed forward, exposed backward)`` seconds of one layer's ring.

    Args:
        tokens: Tokens of each sample of the micro-batch.
        ulysses_degree: ``u``.
        ring_degree: ``r``.
        forward_s_per_pair: Seconds per (query, key) pair of a forward on one GPU (all heads).
        backward_s_per_pair: The same for the backward.
        kv_bytes_per_token: Key and value bytes of one token for this rank's heads.
        query_channels: Heads x head size of this rank's queries (``H/u x Dh``).
        links: The p2p links.
        crosses_nodes: Whether the ring's hops cross nodes.
        hbm_bytes_per_s: Memory bandwidth (merges).
    """
    u, r = ulysses_degree, ring_degree
    s = np.asarray(tokens, dtype=np.float64)
    if u < 1 or r < 1 or (s <= 0).any():
        raise ValueError(f"need u, r >= 1 and positive tokens; got u={u}, r={r}, tokens={list(tokens)}")
    pairs_per_step = float((s**2).sum()) / (u * r * r)
    block_tokens = float(s.sum()) / r
    fwd_block, bwd_block = forward_s_per_pair * pairs_per_step, backward_s_per_pair * pairs_per_step
    if r == 1:
        return fwd_block, bwd_block, 0.0, 0.0
    hop = float(p2p_time_s(links, block_tokens * kv_bytes_per_token, crosses_nodes=crosses_nodes))
    hop2 = float(p2p_time_s(links, 2 * block_tokens * kv_bytes_per_token, crosses_nodes=crosses_nodes))
    merges = (r - 1) * block_tokens * query_channels * MERGE_BYTES_PER_CHANNEL / hbm_bytes_per_s
    forward = (r - 1) * max(fwd_block, hop) + fwd_block + merges
    backward = (r - 1) * max(bwd_block, hop2) + bwd_block + hop
    return forward, backward, forward - r * fwd_block, backward - r * bwd_block


def ring_layer_time_s(cost_model: CostModel, tokens: Sequence[int], *, ulysses_degree: int, ring_degree: int,
                      first_rank: int, links: P2PLinks) -> RingLayerTime:
    """One layer's attention and its communication on a ``u x r`` group placed at ``first_rank``.

    The ring from :func:`ring_attention_time_s` with the cost model's attention coefficients
    (``compute.forward/backward.per_attn_pair``), the model's heads and the hardware's HBM
    bandwidth; the all-to-alls as a Ulysses group of ``u`` (the cost model's all-to-all links
    and bytes per token, ``sum s_i / d`` tokens per rank, key/value replication past ``H_kv``).
    """
    u, r = ulysses_degree, ring_degree
    d, gpn = u * r, cost_model.cluster.gpus_per_node
    model, comm = cost_model.file.model, cost_model.file.comm
    crosses = nodes_spanned(first_rank=first_rank, group_size=d, gpus_per_node=gpn) > 1
    forward, backward, exp_f, exp_b = ring_attention_time_s(
        tokens, ulysses_degree=u, ring_degree=r,
        forward_s_per_pair=cost_model.file.compute.forward.per_attn_pair,
        backward_s_per_pair=cost_model.file.compute.backward.per_attn_pair,
        kv_bytes_per_token=kv_bytes_per_token(model, ulysses_degree=u),
        query_channels=model.num_heads // u * model.head_size, links=links, crosses_nodes=crosses,
        hbm_bytes_per_s=cost_model.cluster.hardware.hbm_bandwidth_bytes_per_s)
    a2a = 0.0
    if u > 1:
        nodes = max(nodes_spanned(first_rank=first_rank + j * u, group_size=u, gpus_per_node=gpn) for j in range(r))
        alpha, per_byte = collective_cost(comm, "alltoall", group_size=u, num_nodes=nodes)
        per_token = (comm.alltoall_bytes_per_token_layer
                     + comm.alltoall_kv_head_bytes_per_token_layer * cost_model.kv_replicas(u))
        a2a = (comm.alltoall_ops_per_layer * alpha
               + float(wire_bytes("alltoall", per_token, u)) * per_byte * sum(tokens) / d)
    return RingLayerTime(forward_s=forward, backward_s=backward, exposed_forward_s=exp_f,
                         exposed_backward_s=exp_b, alltoall_forward_s=a2a)


def ring_kv_buffer_bytes(tokens: Sequence[int], model: ModelSpec, *, ulysses_degree: int, ring_degree: int,
                         element_bytes: float = 2.0) -> float:
    """Extra bytes one rank holds for the ring at its peak: two key/value blocks in forward (the
    block in hand and the one arriving), four in backward (both blocks' keys and values and their
    gradients); 0 for a pure Ulysses group (``ring_degree == 1``)."""
    if ring_degree <= 1:
        return 0.0
    block = math.fsum(tokens) / ring_degree * kv_bytes_per_token(model, ulysses_degree=ulysses_degree,
                                                                  element_bytes=element_bytes)
    return 4.0 * block
