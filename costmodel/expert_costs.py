"""Expert parallelism in the cost model: the token all-to-alls of every MoE layer and the model
states of experts split over ``ClusterSpec.expert_parallel_size`` ranks.

With an expert-parallel size ``e`` (contiguous ranks, ``ceil(e / G)`` nodes) each rank holds
``E / e`` experts of each MoE layer. In every pass of a MoE layer a rank sends each of its tokens'
``k`` routed copies (``h`` values) to the ranks of their experts and gets the outputs back: two
all-to-alls over the ``e`` ranks [L21 in :mod:`costmodel.layer_mix`], timed by the one collective
formula (:func:`costmodel.collectives.collective_cost`) with ``(e-1)/e`` of the bytes sent. The
planner charges them; the executor does not run expert parallelism (its experts are whole on every
rank, sharded by FSDP2 like the other weights).

Model states (``grad_sync.model_state`` for the dense part): bf16 parameters and gradients of
``D + X/e`` parameters (``D`` outside the experts, ``X`` all experts); fp32 master weights and Adam
moments of the same, sharded by ZeRO-1/FSDP2 over the ``N/e`` replicas of each expert shard and
the ``N`` ranks for the rest (``12 (D + X) / N``), replicated otherwise (``12 (D + X/e)``).
Gradient sync moves each rank's ``D + X/e`` gradients (:func:`local_num_params`; the expert shards'
all-reduce runs over the ``N/e`` ranks holding the same shard, priced here over the world as the
dense part's).
"""

from __future__ import annotations

import math

from costmodel.collectives import collective_cost, wire_bytes
from costmodel.grad_sync import ADAM_MOMENTS, FP32_BYTES, ModelStateBytes, model_state
from costmodel.layer_mix import expert_alltoall_bytes_per_token_layer, expert_params
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec

ALLTOALLS_PER_MOE_PASS = 2
"""Dispatch and combine: the all-to-alls of one MoE layer in one pass [L21]."""


def check_expert_parallel(file: CostModelFile, cluster: ClusterSpec) -> None:
    """Refuse an expert-parallel size the model cannot split its experts by.

    Raises:
        ValueError: naming ``expert_parallel_size`` and the model's experts.
    """
    e, model = cluster.expert_parallel_size, file.model
    if e > 1 and (not model.num_experts or model.num_experts % e):
        raise ValueError(f"expert_parallel_size={e} must divide the experts of {model.name!r} "
                         f"(num_experts={model.num_experts})")


def expert_alltoall_per_pass(file: CostModelFile, cluster: ClusterSpec) -> tuple[float, float]:
    """(latency seconds per layer call per pass, seconds per token-per-rank per pass) of the expert
    all-to-alls, both averaged over the layers (the MoE layers' share); 0 without expert parallelism."""
    e, model = cluster.expert_parallel_size, file.model
    if e <= 1:
        return 0.0, 0.0
    nodes = max(1, math.ceil(e / cluster.gpus_per_node))
    alpha, per_byte = collective_cost(file.comm, "alltoall", group_size=e, num_nodes=nodes)
    sent = float(wire_bytes("alltoall", expert_alltoall_bytes_per_token_layer(model), e))
    moe_share = model.num_moe_layers / model.num_layers
    return ALLTOALLS_PER_MOE_PASS * alpha * moe_share, sent * per_byte


def local_num_params(file: CostModelFile, cluster: ClusterSpec) -> int:
    """Parameters one rank holds and syncs: ``D + X/e`` (all of them without expert parallelism)."""
    experts = expert_params(file.model) if cluster.expert_parallel_size > 1 else 0
    return round(file.num_params - experts + experts / cluster.expert_parallel_size)


def expert_model_state(file: CostModelFile, cluster: ClusterSpec) -> ModelStateBytes:
    """Model states per rank with the experts split over ``expert_parallel_size`` ranks."""
    dense = model_state(cluster, num_params=local_num_params(file, cluster))
    if cluster.state_sharding == "replicated":
        return dense
    fp32 = (1 + ADAM_MOMENTS) * FP32_BYTES * file.num_params / cluster.num_gpus
    return ModelStateBytes(params_bytes=dense.params_bytes, grads_bytes=dense.grads_bytes, fp32_state_bytes=fp32)
