"""Evaluate a cost-model file on a cluster: time and memory of samples, micro-batches, steps.

A checkpoint policy is the number ``k`` of the model's ``L`` layers whose activations are
recomputed in backward: ``k = 0`` is ``none``, ``k = L`` is ``full``, anything between is
selective. All sample-level functions accept numpy arrays (broadcasting) as well as scalars,
so that planners can tabulate costs for whole batches at once.

Memory of a micro-batch is additive over its samples (each sample's kept activations plus,
when it recomputes, one layer of its activations rematerialised in backward): a safe upper
bound of the true peak that keeps the planner's memory constraints linear.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.schema import CostModelFile, LayerTimeTerms
from costmodel.specs import ClusterSpec, Sample

FloatArray = NDArray[np.float64]


def policy_name(recompute_layers: int, num_layers: int) -> str:
    """``none``, ``full`` or ``selective-k`` for ``k`` recomputed layers of ``num_layers``."""
    if recompute_layers == 0:
        return "none"
    if recompute_layers == num_layers:
        return "full"
    return f"selective-{recompute_layers}"


def parse_policy(name: str, num_layers: int) -> int:
    """Inverse of :func:`policy_name`.

    Raises:
        ValueError: for an unknown name or a layer count outside ``[0, num_layers]``.
    """
    if name == "none":
        return 0
    if name == "full":
        return num_layers
    if name.startswith("selective-"):
        try:
            k = int(name.removeprefix("selective-"))
        except ValueError:
            raise ValueError(f"checkpoint policy {name!r} is not none, full or selective-K") from None
        if not 0 <= k <= num_layers:
            raise ValueError(f"checkpoint policy {name!r}: K must be in [0, {num_layers}]")
        return k
    raise ValueError(f"checkpoint policy {name!r} is not none, full or selective-K")


def nodes_spanned(*, first_rank: int, group_size: int, gpus_per_node: int) -> int:
    """Nodes touched by the contiguous ranks ``[first_rank, first_rank + group_size)``."""
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    last = first_rank + group_size - 1
    return last // gpus_per_node - first_rank // gpus_per_node + 1


def _layer_time(terms: LayerTimeTerms, tokens: FloatArray, frames: FloatArray, spatial: FloatArray,
                is_2d: bool, group_size: float) -> FloatArray:
    if is_2d:
        split = (terms.per_token * tokens
                 + terms.per_spatial_pair * frames * spatial * spatial
                 + terms.per_temporal_pair * spatial * frames * frames)
    else:
        split = terms.per_token * tokens + terms.per_attn_pair * tokens * tokens
    return split / group_size + terms.per_sample


@dataclass(frozen=True, slots=True)
class CostModel:
    """A cost-model file bound to a cluster.

    Attributes:
        file: The coefficients.
        cluster: The world (ranks per node, memory, state sharding).
    """

    file: CostModelFile
    cluster: ClusterSpec

    @property
    def num_layers(self) -> int:
        """Layers ``L`` of the model (the range of checkpoint policies is ``0..L``)."""
        return self.file.model.num_layers

    @property
    def is_2d(self) -> bool:
        """True for spatial+temporal video models."""
        return self.file.model.kind == "2d"

    def allowed_group_sizes(self, *, max_size: int | None = None) -> list[int]:
        """Group sizes the model's heads allow, up to ``max_size`` (default: world size)."""
        limit = self.cluster.num_gpus if max_size is None else min(max_size, self.cluster.num_gpus)
        return self.file.model.allowed_group_sizes(max_size=limit)

    def default_nodes(self, group_size: int) -> int:
        """Nodes an aligned contiguous group of this size spans."""
        return max(1, math.ceil(group_size / self.cluster.gpus_per_node))

    # ----------------------------------------------------------------- time
    def alltoall_time_s(self, bytes_per_rank: ArrayLike, *, group_size: int, num_nodes: int | None = None
                        ) -> FloatArray:
        """Time of one all-to-all where each rank holds ``bytes_per_rank``.

        A rank keeps ``1/d`` of its data and sends the rest; with the group spread evenly over
        ``n`` nodes, ``(d/n - 1)/(d - 1)`` of what it sends stays inside the node. Intra- and
        inter-node traffic proceed in parallel; the slower one sets the time.
        """
        data = np.asarray(bytes_per_rank, dtype=np.float64)
        if group_size == 1:
            return np.zeros_like(data)
        n = self.default_nodes(group_size) if num_nodes is None else num_nodes
        sent = data * (group_size - 1) / group_size
        intra_share = (group_size / n - 1) / (group_size - 1)
        intra = self.file.comm.link("alltoall", placement="intra", group_size=group_size)
        time = intra.alpha_s + sent * intra_share / intra.bytes_per_s
        if n > 1:
            inter = self.file.comm.link("alltoall", placement="inter", group_size=group_size)
            time = np.maximum(time, inter.alpha_s + sent * (1 - intra_share) / inter.bytes_per_s)
        return np.asarray(time, dtype=np.float64)

    def sample_time_s(
        self,
        tokens: ArrayLike,
        *,
        group_size: int,
        recompute_layers: ArrayLike = 0,
        frames: ArrayLike = 1,
        spatial: ArrayLike | None = None,
        num_nodes: int | None = None,
    ) -> FloatArray:
        """Forward+backward time of samples on one group, excluding the micro-batch overhead.

        Args:
            tokens: Tokens per sample.
            group_size: SP group size ``d``.
            recompute_layers: Checkpoint policy ``k`` per sample (0 none .. L full).
            frames: Frames per sample (2D); ignored for 1D models.
            spatial: Tokens per frame (2D); defaults to ``tokens / frames``.
            num_nodes: Nodes the group spans; default: an aligned contiguous placement.

        Returns:
            Seconds per sample (same shape as the broadcast inputs).
        """
        s = np.asarray(tokens, dtype=np.float64)
        f = np.asarray(frames, dtype=np.float64)
        hw = s / f if spatial is None else np.asarray(spatial, dtype=np.float64)
        k = np.asarray(recompute_layers, dtype=np.float64)
        c = self.file.compute
        fwd = _layer_time(c.forward, s, f, hw, self.is_2d, group_size)
        bwd = _layer_time(c.backward, s, f, hw, self.is_2d, group_size)
        layers = self.num_layers
        compute = layers * (fwd + bwd) + k * fwd + c.head_s_per_token * s / group_size
        comm = self.file.comm
        per_op_bytes = comm.alltoall_bytes_per_token_layer * s / group_size / max(comm.alltoall_ops_per_layer, 1)
        layer_comm = comm.alltoall_ops_per_layer * self.alltoall_time_s(
            per_op_bytes, group_size=group_size, num_nodes=num_nodes
        )
        # Forward and backward each run the layer's all-to-alls; a recomputed layer repeats them.
        total = compute + (2 * layers + k) * layer_comm
        return np.asarray(total, dtype=np.float64)

    def microbatch_time_s(self, samples: Sequence[Sample], *, group_size: int,
                          recompute_layers: Sequence[int], num_nodes: int | None = None) -> float:
        """Time of one micro-batch: fixed overhead plus its samples."""
        if len(samples) != len(recompute_layers):
            raise ValueError(f"{len(samples)} samples but {len(recompute_layers)} policies")
        if not samples:
            return 0.0
        times = self.sample_time_s(
            [s.tokens for s in samples], group_size=group_size, recompute_layers=list(recompute_layers),
            frames=[s.num_frames for s in samples], spatial=[s.spatial_tokens for s in samples],
            num_nodes=num_nodes,
        )
        return float(self.file.compute.microbatch_overhead_s + times.sum())

    def grad_sync_time_s(self) -> float:
        """One gradient all-reduce (or reduce-scatter + all-gather) over the whole world.

        Ring algorithm: each rank sends ``2*(N-1)/N`` of the gradient bytes; across nodes the
        network is the bottleneck.
        """
        n = self.cluster.num_gpus
        if n == 1:
            return 0.0
        placement = "inter" if self.cluster.num_nodes > 1 else "intra"
        link = self.file.comm.link("allreduce", placement=placement, group_size=n)
        grad_bytes = self.file.num_params * self.file.comm.grad_bytes_per_param
        return link.alpha_s + 2 * (n - 1) / n * grad_bytes / link.bytes_per_s

    # --------------------------------------------------------------- memory
    def model_state_bytes(self) -> float:
        """Model states per rank: bf16 params and grads, fp32 master + Adam moments [R20]."""
        p = float(self.file.num_params)
        n = self.cluster.num_gpus
        sharding = self.cluster.state_sharding
        if sharding == "replicated":
            return 16 * p
        if sharding == "zero1":
            return 4 * p + 12 * p / n
        if sharding == "zero2":
            return 2 * p + 14 * p / n
        return 16 * p / n

    def activation_bytes(self, tokens: ArrayLike, *, group_size: int, recompute_layers: ArrayLike = 0
                         ) -> FloatArray:
        """Activation bytes one rank holds for samples under a policy (additive per sample).

        ``s/d * ((L-k)*none + k*full + working)``, plus one layer of ``none`` activations
        rematerialised in backward when ``k > 0``.
        """
        s = np.asarray(tokens, dtype=np.float64)
        k = np.asarray(recompute_layers, dtype=np.float64)
        a = self.file.activation
        layers = self.num_layers
        per_token = ((layers - k) * a.bytes_per_token_layer_none + k * a.bytes_per_token_layer_full
                     + a.working_bytes_per_token + np.where(k > 0, a.bytes_per_token_layer_none, 0.0))
        return np.asarray(s / group_size * per_token, dtype=np.float64)

    def fixed_bytes(self) -> float:
        """Per-rank memory independent of the batch: model states and working buffers."""
        return self.model_state_bytes() + self.file.activation.fixed_working_bytes

    def activation_budget_bytes(self) -> float:
        """Bytes left for activations under the memory cap (may be negative)."""
        return self.cluster.memory_cap_bytes - self.fixed_bytes()

    def microbatch_peak_bytes(self, samples: Sequence[Sample], *, group_size: int,
                              recompute_layers: Sequence[int]) -> float:
        """Peak bytes per rank while a micro-batch runs."""
        if len(samples) != len(recompute_layers):
            raise ValueError(f"{len(samples)} samples but {len(recompute_layers)} policies")
        act = self.activation_bytes([s.tokens for s in samples], group_size=group_size,
                                    recompute_layers=list(recompute_layers))
        return float(self.fixed_bytes() + act.sum())

    def fits(self, sample: Sample, *, group_size: int, recompute_layers: int) -> bool:
        """True when the sample alone fits one rank of the group under the cap."""
        act = float(self.activation_bytes(sample.tokens, group_size=group_size,
                                          recompute_layers=recompute_layers))
        return act <= self.activation_budget_bytes()
