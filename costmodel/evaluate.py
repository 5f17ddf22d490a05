"""Evaluate a cost-model file on a cluster: time and memory of samples, micro-batches, steps.

A checkpoint policy is the number ``k`` of the model's ``L`` layers whose activations are
recomputed in backward: ``k = 0`` is ``none``, ``k = L`` is ``full``, anything between is
selective. All sample-level functions accept numpy arrays (broadcasting) as well as scalars,
so that planners can tabulate costs for whole batches at once.

Time of a micro-batch = a fixed part that depends only on the group and on how many *calls*
of each layer the executor makes (``microbatch_fixed_s``: every layer runs once per pass, twice
where the micro-batch mixes checkpointed and plain samples at that layer, and once more in
backward for the recompute) + a part additive over its samples (``sample_time_s``). The
collectives follow what the executor issues: per attention one all-to-all in (q, k, v fused)
and one out in forward, the same two in backward and again in a recompute, all timed by
:func:`costmodel.collectives.collective_time_s`, the one formula that ``costmodel.fit``
fits.

A group that splits attention as Ulysses over ``u`` ranks x ring over ``r`` rank-sets
(``layout``, :class:`costmodel.ring.layout.GroupLayout`; issue 25) keeps every per-token and per-pair
compute term at its size ``d = u r`` (the ring's steps add up to the ``s^2/d`` pairs), runs its
all-to-alls over the ``u`` ranks of a Ulysses subgroup (bytes, latency and nodes of that
subgroup, key/value replication past ``H_kv`` over ``u``) and adds what the ring does not hide
(:mod:`costmodel.ring.costs`). Memory (model states, working buffers, a micro-batch's samples,
the ring's key/value buffers) is :mod:`costmodel.memory_costs`; ``CostModel`` is the three parts
bound to one file and cluster.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.collectives import collective_cost, collective_time_s, wire_bytes
from costmodel.expert_costs import check_expert_parallel, expert_alltoall_per_pass, local_num_params
from costmodel.grad_sync import SyncCalls, sync_calls
from costmodel.layer_mix import attention_pairs
from costmodel.memory_costs import MemoryCosts
from costmodel.model_terms import terms as kind_terms
from costmodel.pass_terms import sample_pass_s
from costmodel.policy import parse_policy, policy_name
from costmodel.ring.costs import RingCosts
from costmodel.ring.layout import GroupLayout, nodes_spanned
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample

__all__ = ["CostModel", "GroupLayout", "nodes_spanned", "parse_policy", "policy_name"]

FloatArray = NDArray[np.float64]


SUPPORTED_STATE_SHARDING = ("replicated", "zero1")
"""Model-state layouts the executor runs: gradients replicated and summed by one all-reduce per
step; optimizer states replicated or sharded (ZeRO-1, e.g. torch's ZeroRedundancyOptimizer)."""


@dataclass(frozen=True, slots=True)
class CostModel(RingCosts, MemoryCosts):
    """A cost-model file bound to a cluster: time here, a ring's costs in
    :class:`costmodel.ring.costs.RingCosts`, memory in :class:`costmodel.memory_costs.MemoryCosts`.

    Attributes:
        file: The coefficients.
        cluster: The world (ranks per node, memory, state sharding).

    Raises:
        ValueError: for a file made for other hardware than the cluster's, or a state sharding
            the executor does not run (ZeRO-2/3 shard gradients, the executor keeps them whole
            until its one all-reduce).
    """

    file: CostModelFile
    cluster: ClusterSpec

    def __post_init__(self) -> None:
        if self.file.hardware != self.cluster.hardware.name:
            raise ValueError(
                f"cost model {self.file.id!r} describes hardware {self.file.hardware!r} but cluster "
                f"{self.cluster.name!r} runs {self.cluster.hardware.name!r}: use a cost model of "
                f"{self.cluster.hardware.name!r} (the analytic default, or dcp fit --hardware "
                f"{self.cluster.hardware.name} on a profile made there), or a cluster whose "
                f"hardware is named {self.file.hardware!r}")
        if self.cluster.state_sharding not in SUPPORTED_STATE_SHARDING:
            raise ValueError(
                f"state_sharding={self.cluster.state_sharding!r} is not what the executor runs: it "
                "keeps full gradients over the micro-batches and sums them with one all-reduce per "
                f"step; use one of {list(SUPPORTED_STATE_SHARDING)} (zero1 = optimizer states "
                "sharded, e.g. torch ZeroRedundancyOptimizer)")
        check_expert_parallel(self.file, self.cluster)

    @property
    def num_layers(self) -> int:
        """Layers ``L`` of the model (the range of checkpoint policies is ``0..L``)."""
        return self.file.model.num_layers

    @property
    def is_2d(self) -> bool:
        """True for spatial+temporal video models (a sample's pairs need its frames)."""
        return self.attention == "spatial_temporal"

    @property
    def attention(self) -> str:
        """Which pairs the model's attention has (``costmodel.model_terms.KindTerms.attention``)."""
        return kind_terms(self.file.model).attention

    def kv_replicas(self, group_size: int) -> int:
        """Key/value heads a group adds by replication: ``max(0, d - kv_heads)`` (GQA past its
        key/value heads: each rank gets the head its query heads use)."""
        return max(0, group_size - self.file.model.kv_heads)

    def allowed_group_sizes(self, *, max_size: int | None = None) -> list[int]:
        """Group sizes the model's heads allow, up to ``max_size`` (default: world size)."""
        limit = self.cluster.num_gpus if max_size is None else min(max_size, self.cluster.num_gpus)
        return self.file.model.allowed_group_sizes(max_size=limit)

    def default_nodes(self, group_size: int) -> int:
        """Nodes an aligned contiguous group of this size spans."""
        return max(1, math.ceil(group_size / self.cluster.gpus_per_node))

    def place(self, *, first_rank: int, group_size: int, ring_degree: int = 1) -> GroupLayout:
        """The layout of a group of contiguous ranks on this cluster (:meth:`GroupLayout.place`)."""
        return GroupLayout.place(first_rank=first_rank, group_size=group_size, ring_degree=ring_degree,
                                 gpus_per_node=self.cluster.gpus_per_node)

    @staticmethod
    def _alltoall_group(group_size: int, num_nodes: int | None, layout: GroupLayout | None
                        ) -> tuple[int, int | None]:
        """``(ranks, nodes)`` of the all-to-alls: the group's (``num_nodes``, else the layout's), or
        its Ulysses subgroup's under a ring layout.

        Raises:
            ValueError: when the layout's degrees do not multiply to ``group_size``.
        """
        if layout is None:
            return group_size, num_nodes
        if layout.group_size != group_size:
            raise ValueError(f"layout ulysses_degree={layout.ulysses_degree} x ring_degree={layout.ring_degree} "
                             f"does not multiply to the group size {group_size}")
        if layout.ring_degree == 1:
            return group_size, layout.alltoall_nodes if num_nodes is None else num_nodes
        return layout.ulysses_degree, layout.alltoall_nodes

    # ----------------------------------------------------------------- time
    def alltoall_time_s(self, bytes_per_rank: ArrayLike, *, group_size: int, num_nodes: int | None = None
                        ) -> FloatArray:
        """Time of one all-to-all where each rank holds ``bytes_per_rank`` (:func:`collective_time_s`)."""
        nodes = self.default_nodes(group_size) if num_nodes is None else num_nodes
        return collective_time_s(self.file.comm, "alltoall", bytes_per_rank, group_size=group_size,
                                 num_nodes=nodes)

    def _alltoall_per_pass(self, group_size: int, num_nodes: int | None) -> tuple[float, float]:
        """(latency seconds per layer call per pass, seconds per token-per-rank per pass)."""
        if group_size <= 1:
            return 0.0, 0.0
        comm = self.file.comm
        nodes = self.default_nodes(group_size) if num_nodes is None else num_nodes
        alpha, per_byte = collective_cost(comm, "alltoall", group_size=group_size, num_nodes=nodes)
        bytes_per_token = (comm.alltoall_bytes_per_token_layer + comm.alltoall_kv_head_bytes_per_token_layer
                           * self.kv_replicas(group_size))
        sent_per_token = float(wire_bytes("alltoall", bytes_per_token, group_size))
        return comm.alltoall_ops_per_layer * alpha, sent_per_token * per_byte

    def sample_time_s(
        self,
        tokens: ArrayLike,
        *,
        group_size: int,
        recompute_layers: ArrayLike = 0,
        frames: ArrayLike = 1,
        spatial: ArrayLike | None = None,
        num_nodes: int | None = None,
        layout: GroupLayout | None = None,
    ) -> FloatArray:
        """The part of a micro-batch's time that each sample adds (see :meth:`microbatch_fixed_s`).

        Args:
            tokens: Tokens per sample.
            group_size: SP group size ``d``.
            recompute_layers: Checkpoint policy ``k`` per sample (0 none .. L full).
            frames: Frames per sample (2D); ignored for 1D models.
            spatial: Tokens per frame (2D); defaults to ``tokens / frames``.
            num_nodes: Nodes the group spans; default: an aligned contiguous placement.
            layout: Ulysses x ring layout of the group (None: Ulysses over all ``group_size``).
                Under a ring the all-to-alls are the Ulysses subgroup's; the ring's own cost is
                per layer call, not per sample (:meth:`ring_exposed_s`).

        Returns:
            Seconds per sample (same shape as the broadcast inputs).
        """
        s = np.asarray(tokens, dtype=np.float64)
        f = np.asarray(frames, dtype=np.float64)
        hw = s / f if spatial is None else np.asarray(spatial, dtype=np.float64)
        k = np.asarray(recompute_layers, dtype=np.float64)
        c = self.file.compute
        curves = c.attention_efficiency
        # windowed layers: fewer pairs than s^2 (None keeps the dense s*s)
        pairs = attention_pairs(self.file.model, s) if self.file.model.num_sliding_layers else None
        fwd, bwd = (sample_pass_s(terms, s, f, hw, attention=self.attention, group_size=float(group_size),
                                  half_tokens=c.attention_half_tokens, efficiency=curve, whole_pairs=pairs)
                    for terms, curve in ((c.forward, curves.forward if curves else None),
                                         (c.backward, curves.backward if curves else None)))
        layers = self.num_layers
        _, comm_per_token = self._alltoall_per_pass(*self._alltoall_group(group_size, num_nodes, layout))
        comm_per_token += expert_alltoall_per_pass(self.file, self.cluster)[1]
        per_rank = s / group_size
        total = (layers * (fwd + bwd) + k * fwd + c.head_s_per_token * per_rank
                 + (2 * layers + k) * comm_per_token * per_rank)
        return np.asarray(total, dtype=np.float64)

    def layer_call_s(self, *, group_size: int, num_nodes: int | None = None,
                     layout: GroupLayout | None = None) -> tuple[float, float]:
        """Fixed seconds of one call of a layer: ``(forward, backward)``.

        Each is the call's fixed work (``per_call``), the dense parts' efficiency term
        ``per_token * linear_half_tokens`` and the latency of its all-to-alls.
        """
        c = self.file.compute
        alpha, _ = self._alltoall_per_pass(*self._alltoall_group(group_size, num_nodes, layout))
        alpha += expert_alltoall_per_pass(self.file, self.cluster)[0]
        fwd = c.forward.per_call + c.forward.per_token * c.linear_half_tokens + alpha
        bwd = c.backward.per_call + c.backward.per_token * c.linear_half_tokens + alpha
        return fwd, bwd

    def layer_calls(self, recompute_layers: Sequence[int] | NDArray[np.int64]) -> tuple[int, int]:
        """``(forward+backward calls, recompute calls)`` per micro-batch with these policies.

        Every layer runs once per pass; a layer where some samples are checkpointed and others
        are not runs twice (the executor calls it on each subset); each of the first ``max(k)``
        layers reruns its forward once in backward.
        """
        if len(recompute_layers) == 0:
            return 0, 0
        hi, lo = int(max(recompute_layers)), int(min(recompute_layers))
        return self.num_layers + hi - lo, hi

    def microbatch_fixed_s(self, *, group_size: int, num_nodes: int | None = None,
                           recompute_layers: Sequence[int] | NDArray[np.int64] = (0,),
                           layout: GroupLayout | None = None) -> float:
        """The part of a micro-batch's time that does not grow with its samples.

        ``microbatch_overhead_s`` plus the fixed seconds of every layer call
        (:meth:`layer_call_s`, :meth:`layer_calls`).
        """
        fwd, bwd = self.layer_call_s(group_size=group_size, num_nodes=num_nodes, layout=layout)
        calls, recompute = self.layer_calls(recompute_layers)
        return self.file.compute.microbatch_overhead_s + calls * (fwd + bwd) + recompute * fwd

    def microbatch_time_s(self, samples: Sequence[Sample], *, group_size: int,
                          recompute_layers: Sequence[int], num_nodes: int | None = None,
                          layout: GroupLayout | None = None) -> float:
        """Time of one micro-batch: its fixed part plus its samples, plus under a ring layout
        what its rings do not hide (:meth:`ring_exposed_s`)."""
        if len(samples) != len(recompute_layers):
            raise ValueError(f"{len(samples)} samples but {len(recompute_layers)} policies")
        if not samples:
            return 0.0
        times = self.sample_time_s(
            [s.tokens for s in samples], group_size=group_size, recompute_layers=list(recompute_layers),
            frames=[s.num_frames for s in samples], spatial=[s.spatial_tokens for s in samples],
            num_nodes=num_nodes, layout=layout,
        )
        fixed = self.microbatch_fixed_s(group_size=group_size, num_nodes=num_nodes,
                                        recompute_layers=list(recompute_layers), layout=layout)
        ring = 0.0
        if layout is not None and layout.ring_degree > 1:
            ring = self.ring_exposed_s([s.tokens for s in samples], list(recompute_layers), layout=layout)
        return float(fixed + times.sum() + ring)

    def grad_sync_calls(self) -> tuple[SyncCalls, ...]:
        """The collectives of one step's gradient sync under ``cluster.grad_sync``
        (:func:`costmodel.grad_sync.sync_calls`)."""
        return sync_calls(self.cluster, model=self.file.model, num_params=local_num_params(self.file, self.cluster),
                          grad_bytes_per_param=self.file.comm.grad_bytes_per_param)

    def grad_sync_time_s(self) -> float:
        """Gradient sync of one step over the whole world, as the executor runs it.

        Each call of :meth:`grad_sync_calls` timed by :func:`collective_time_s` over the world:
        allreduce one ring all-reduce (``2*(N-1)`` latency terms, ``2*(N-1)/N`` of the bytes sent
        per rank), ddp one per bucket, fsdp2 ``L+1`` all-gathers and ``L+1`` reduce-scatters
        (``N-1`` latency terms, ``(N-1)/N`` of the bytes each); with ZeRO-1 (allreduce, ddp)
        also the all-gather of the updated parameters.
        """
        n = self.cluster.num_gpus
        if n == 1:
            return 0.0
        comm, nodes = self.file.comm, self.cluster.num_nodes
        return sum(call.num_calls * float(collective_time_s(
            comm, call.op, call.bytes_per_rank / call.num_calls, group_size=n, num_nodes=nodes))
            for call in self.grad_sync_calls())

