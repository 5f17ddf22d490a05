"""Tiny worlds for exhaustive checks: a 3-layer 1D model with a few KB of memory per rank.

The coefficients are chosen so that every decision matters on a handful of samples: group
size (all-to-all latency vs. split compute), micro-batch splits (overhead vs. memory),
checkpoint policy (recompute time vs. memory) and the node boundary (2 ranks per node).
"""

from __future__ import annotations

from costmodel.schema import (
    ActivationCoefficients,
    CommCoefficients,
    ComputeCoefficients,
    CostModelFile,
    LayerTimeTerms,
    LinkFit,
)
from costmodel.specs import ClusterSpec, HardwareSpec, ModelSpec, Sample

TINY_HW = HardwareSpec(name="tiny-gpu", hbm_bytes=4.0e6, hbm_bandwidth_bytes_per_s=1e12,
                       bf16_dense_flops=1e12, nvlink_bytes_per_s_per_direction=1e9,
                       network_bytes_per_s_per_gpu=1e8)


def tiny_cost_model(*, num_heads: int = 4, num_layers: int = 3) -> CostModelFile:
    """A hand-made cost model: memory binds from ~1000 tokens per rank."""
    return CostModelFile(
        id="tiny-test",
        provenance="analytic",
        model=ModelSpec(name="tiny", kind="1d", num_layers=num_layers, hidden=num_heads * 16,
                        num_heads=num_heads, ffn_hidden=128, vocab=0),
        hardware="tiny-gpu",
        num_params=1000,
        compute=ComputeCoefficients(
            forward=LayerTimeTerms(per_token=2e-6, per_attn_pair=1e-9, per_sample=2e-4),
            backward=LayerTimeTerms(per_token=4e-6, per_attn_pair=2.5e-9, per_sample=2e-4),
            microbatch_overhead_s=1.5e-3,
        ),
        activation=ActivationCoefficients(bytes_per_token_layer_none=1000.0,
                                          bytes_per_token_layer_full=100.0,
                                          working_bytes_per_token=50.0, fixed_working_bytes=0.0),
        comm=CommCoefficients(
            alltoall_bytes_per_token_layer=200.0,
            alltoall_ops_per_layer=4,
            alltoall=[LinkFit(placement="intra", alpha_s=5e-5, bytes_per_s=1e9),
                      LinkFit(placement="inter", alpha_s=2e-4, bytes_per_s=1e8)],
            allreduce=[LinkFit(placement="intra", alpha_s=1e-5, bytes_per_s=1e10),
                       LinkFit(placement="inter", alpha_s=3e-5, bytes_per_s=1e9)],
        ),
    )


def tiny_cluster(*, num_gpus: int = 4, gpus_per_node: int = 2, hbm_bytes: float = 4.0e6
                 ) -> ClusterSpec:
    """A small world; ZeRO-3 keeps the model states at a few KB per rank."""
    hw = TINY_HW.model_copy(update={"hbm_bytes": hbm_bytes})
    return ClusterSpec(name=f"tiny{num_gpus}", hardware=hw, num_gpus=num_gpus,
                       gpus_per_node=gpus_per_node, memory_cap_fraction=1.0,
                       state_sharding="zero1")


def samples_of(tokens: list[int], prefix: str = "s") -> list[Sample]:
    """1D samples with ids ``<prefix><index>``."""
    return [Sample(id=f"{prefix}{i}", tokens=t) for i, t in enumerate(tokens)]
