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
(``layout``, :class:`costmodel.layout.GroupLayout`; issue 25) keeps every per-token and per-pair
compute term at its size ``d = u r`` (the ring's steps add up to the ``s^2/d`` pairs), runs its
all-to-alls over the ``u`` ranks of a Ulysses subgroup (bytes, latency and nodes of that
subgroup, key/value replication past ``H_kv`` over ``u``) and adds what the ring does not hide
(:func:`costmodel.ring_time.ring_attention_time_s`'s exposed hops and merges) for every layer
call of the micro-batch, the recomputed ones included (:meth:`CostModel.ring_exposed_s`: not
additive over samples, since a hop carries the whole call's block). Its memory adds the ring's
key/value buffers (:func:`costmodel.ring_time.ring_kv_buffer_bytes`).

Memory of a micro-batch is additive over its samples: each sample's kept activations (a fully
checkpointed sample also one rematerialised layer, see ``activation_bytes``) and the transient
working set of a layer's backward per token: the peak the executor reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.collectives import collective_cost, collective_time_s, wire_bytes
from costmodel.grad_sync import ModelStateBytes, SyncCalls, model_state, sync_calls
from costmodel.layout import GroupLayout, nodes_spanned
from costmodel.model_terms import terms as kind_terms
from costmodel.pass_terms import sample_pass_s
from costmodel.policy import parse_policy, policy_name
from costmodel.ring_time import (
    RingLayerTime,
    calls_exposed_s,
    default_p2p_links,
    kv_bytes_per_token,
    ring_attention_time_s,
    ring_steps_s,
)
from costmodel.schema import CostModelFile, P2PLinks
from costmodel.specs import ClusterSpec, Sample

__all__ = ["CostModel", "GroupLayout", "nodes_spanned", "parse_policy", "policy_name"]

FloatArray = NDArray[np.float64]


SUPPORTED_STATE_SHARDING = ("replicated", "zero1")
"""Model-state layouts the executor runs: gradients replicated and summed by one all-reduce per
step; optimizer states replicated or sharded (ZeRO-1, e.g. torch's ZeroRedundancyOptimizer)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """A cost-model file bound to a cluster.

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

    @property
    def p2p_links(self) -> P2PLinks:
        """The ring's p2p links: the file's (fitted), else (or for an unmeasured inter-node link)
        the hardware's analytic ones (:func:`costmodel.ring_time.default_p2p_links`)."""
        p2p = self.file.comm.p2p
        if p2p is not None and p2p.inter is not None:
            return p2p
        default = default_p2p_links(self.cluster.hardware)
        return default if p2p is None else p2p.model_copy(update={"inter": default.inter})

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
        fwd, bwd = (sample_pass_s(terms, s, f, hw, attention=self.attention, group_size=float(group_size),
                                   half_tokens=c.attention_half_tokens) for terms in (c.forward, c.backward))
        layers = self.num_layers
        _, comm_per_token = self._alltoall_per_pass(*self._alltoall_group(group_size, num_nodes, layout))
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

    def ring_layer_time(self, tokens: Sequence[float], *, layout: GroupLayout,
                        links: P2PLinks | None = None, additive_only: bool = False) -> RingLayerTime:
        """One layer's attention and its all-to-alls on one rank of a ``u x r`` group, per pass.

        The ring from :func:`costmodel.ring_time.ring_attention_time_s` with this file's attention
        coefficients (``compute.forward/backward.per_attn_pair``), the model's heads, the hardware's
        HBM bandwidth and ``links`` (default :attr:`p2p_links`; ``additive_only``: the form that
        bounds a sample's share from below); the all-to-alls as this cost
        model charges a Ulysses subgroup of ``u`` (``sum s_i / d`` tokens per rank).
        """
        u, r = layout.ulysses_degree, layout.ring_degree
        model = self.file.model
        forward, backward, exp_f, exp_b = ring_attention_time_s(
            tokens, ulysses_degree=u, ring_degree=r,
            forward_s_per_pair=self.file.compute.forward.per_attn_pair,
            backward_s_per_pair=self.file.compute.backward.per_attn_pair,
            kv_bytes_per_token=kv_bytes_per_token(model, ulysses_degree=u),
            query_channels=model.num_heads // u * model.head_size,
            links=self.p2p_links if links is None else links, crosses_nodes=layout.ring_crosses_nodes,
            hbm_bytes_per_s=self.cluster.hardware.hbm_bandwidth_bytes_per_s, additive_only=additive_only)
        alpha, per_token = self._alltoall_per_pass(u, layout.alltoall_nodes)
        a2a = alpha + per_token * math.fsum(tokens) / layout.group_size if u > 1 else 0.0
        return RingLayerTime(forward_s=forward, backward_s=backward, exposed_forward_s=exp_f,
                             exposed_backward_s=exp_b, alltoall_forward_s=a2a)

    def ring_alone_exposed_s(self, tokens: ArrayLike, *, layout: GroupLayout, additive_only: bool = False
                             ) -> tuple[FloatArray, FloatArray]:
        """``(forward, backward)`` exposed seconds of one layer's ring for each sample alone in a
        call (:meth:`ring_layer_time` of ``[s]``, vectorised; ``additive_only`` as there)."""
        u, r = layout.ulysses_degree, layout.ring_degree
        s = np.asarray(tokens, dtype=np.float64)
        model = self.file.model
        _, _, exp_f, exp_b = ring_steps_s(
            s * s / (u * r * r), s / r, ring_degree=r,
            forward_s_per_pair=self.file.compute.forward.per_attn_pair,
            backward_s_per_pair=self.file.compute.backward.per_attn_pair,
            kv_bytes_per_token=kv_bytes_per_token(model, ulysses_degree=u),
            query_channels=model.num_heads // u * model.head_size, links=self.p2p_links,
            crosses_nodes=layout.ring_crosses_nodes, hbm_bytes_per_s=self.cluster.hardware.hbm_bandwidth_bytes_per_s,
            additive_only=additive_only)
        return np.asarray(exp_f, dtype=np.float64), np.asarray(exp_b, dtype=np.float64)

    def ring_exposed_s(self, tokens: Sequence[float], recompute_layers: Sequence[int], *,
                       layout: GroupLayout) -> float:
        """Seconds a micro-batch's rings add to its compute: every layer call's exposed forward and
        backward (:meth:`ring_layer_time`), the recomputed forwards again
        (:func:`costmodel.ring_time.calls_exposed_s`); 0 for a pure Ulysses layout."""
        if layout.ring_degree == 1:
            return 0.0

        def exposed(call_tokens: list[float]) -> tuple[float, float]:
            t = self.ring_layer_time(call_tokens, layout=layout)
            return t.exposed_forward_s, t.exposed_backward_s

        return calls_exposed_s(tokens, recompute_layers, num_layers=self.num_layers, exposed=exposed)

    def grad_sync_calls(self) -> tuple[SyncCalls, ...]:
        """The collectives of one step's gradient sync under ``cluster.grad_sync``
        (:func:`costmodel.grad_sync.sync_calls`)."""
        return sync_calls(self.cluster, model=self.file.model, num_params=self.file.num_params,
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

    # --------------------------------------------------------------- memory
    def model_state(self) -> ModelStateBytes:
        """Model states per rank by kind (:func:`costmodel.grad_sync.model_state`)."""
        return model_state(self.cluster, num_params=self.file.num_params)

    def model_state_bytes(self) -> float:
        """Model states per rank at their peak in a step under the cluster's sync mode: bf16
        params and grads, fp32 master weights and Adam moments replicated or sharded [R20]."""
        return self.model_state().total_bytes

    def activation_bytes(self, tokens: ArrayLike, *, group_size: int, recompute_layers: ArrayLike = 0,
                         layout: GroupLayout | None = None) -> FloatArray:
        """Peak bytes one rank holds for samples under a policy (additive per sample).

        ``s/d * (max(L-k, [k>0])*none + k*full + working + max(transient, head_transient))``
        (the head's and loss's backward runs first, on top of every kept layer; then each
        layer's), with ``none`` grown by ``kv_head_bytes_per_token_layer`` per replicated key/value
        head (:meth:`kv_replicas`). Backward runs from the
        last layer down: a checkpointed layer rematerialises its ``none`` activations only after
        the plain layers above it have freed theirs, so the rematerialised layer adds to the peak
        only when every layer is checkpointed (``k = L``, which is then dominated by ``k = L-1``).
        Summed over a micro-batch with mixed policies this bounds the peak from above and is exact
        when they agree. Under a ring layout (``u x r``) the key/value replication is the Ulysses
        subgroup's (``kv_replicas(u)``) and each sample adds the ring's key/value buffers,
        ``4 s/r`` tokens of this rank's key/value heads (:func:`costmodel.ring_time.ring_kv_buffer_bytes`,
        linear in the tokens, so additive as the rest). A joint-attention (MMDiT) model's sample
        adds its ``J`` text tokens, whole on every rank of the group (``executor/joint.py``):
        ``J * (max(L-k, [k>0])*none + k*full)``, per sample and not divided by ``d``.
        """
        u, _ = self._alltoall_group(group_size, None, layout)
        s = np.asarray(tokens, dtype=np.float64)
        k = np.asarray(recompute_layers, dtype=np.float64)
        a = self.file.activation
        layers = self.num_layers
        kept_none_layers = np.maximum(layers - k, np.where(k > 0, 1.0, 0.0))
        none = a.bytes_per_token_layer_none + a.kv_head_bytes_per_token_layer * self.kv_replicas(u)
        per_token = (kept_none_layers * none + k * a.bytes_per_token_layer_full
                     + a.working_bytes_per_token
                     + max(a.transient_bytes_per_token, a.head_transient_bytes_per_token))
        ring: float | FloatArray = 0.0
        if layout is not None and layout.ring_degree > 1:  # = ring_kv_buffer_bytes per sample
            ring = 4.0 * s / layout.ring_degree * kv_bytes_per_token(self.file.model, ulysses_degree=u)
        # joined text tokens (MMDiT): kept per layer like tokens, whole on every rank of the group
        text = self.file.model.joint_attention_tokens * (kept_none_layers * none + k * a.bytes_per_token_layer_full)
        return np.asarray(s / group_size * per_token + ring + text, dtype=np.float64)

    def fixed_working_bytes(self) -> float:
        """Working memory of any micro-batch: the fixed buffers plus the per-layer ones."""
        a = self.file.activation
        return a.fixed_working_bytes + self.num_layers * a.fixed_working_bytes_per_layer

    def fixed_bytes(self) -> float:
        """Per-rank memory independent of the batch: model states and working buffers."""
        return self.model_state_bytes() + self.fixed_working_bytes()

    def activation_budget_bytes(self) -> float:
        """Bytes left for activations under the memory cap (may be negative)."""
        return self.cluster.memory_cap_bytes - self.fixed_bytes()

    def microbatch_peak_bytes(self, samples: Sequence[Sample], *, group_size: int,
                              recompute_layers: Sequence[int], layout: GroupLayout | None = None) -> float:
        """Peak bytes per rank while a micro-batch runs."""
        if len(samples) != len(recompute_layers):
            raise ValueError(f"{len(samples)} samples but {len(recompute_layers)} policies")
        act = self.activation_bytes([s.tokens for s in samples], group_size=group_size,
                                    recompute_layers=list(recompute_layers), layout=layout)
        return float(self.fixed_bytes() + act.sum())

    def fits(self, sample: Sample, *, group_size: int, recompute_layers: int,
             layout: GroupLayout | None = None) -> bool:
        """True when the sample alone fits one rank of the group under the cap."""
        act = float(self.activation_bytes(sample.tokens, group_size=group_size,
                                          recompute_layers=recompute_layers, layout=layout))
        return act <= self.activation_budget_bytes()
