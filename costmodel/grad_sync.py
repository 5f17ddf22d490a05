"""What a step's gradient sync issues and what model states a rank holds, per executor mode.

``ClusterSpec.grad_sync`` names the mode the executor runs (``executor/grad_sync.py``); this
module lists the collectives of one step and the bytes of the model states under that mode, so
that :class:`costmodel.evaluate.CostModel` times them with its one collective formula and the
executor tests can count them (``tests/executor/test_sync_cost_model.py``):

- ``allreduce`` (``AllReduceSync``): one all-reduce of the whole gradients per step.
- ``ddp`` (``DDPSync``): the rank's last backward all-reduces DDP's buckets, one call each.
  From the second step on DDP has rebuilt its buckets in the order the gradients become ready
  (the last layer's first): parameter tensors join the open bucket, which closes once it holds
  ``bucket_cap_mb`` bytes or more, and at DDP's default cap the first bucket closes at 1 MiB
  (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``). :func:`ddp_num_buckets` runs that rule
  on the model's parameter tensors (:func:`param_tensor_elements`): about ``ceil(G / cap)``
  buckets for ``G`` gradient bytes when tensors are much smaller than a bucket, about one per
  tensor when they are larger (a 4096 x 14336 bf16 matrix is 117 MB). DDP's first step runs one
  bucket (it buckets by readiness only once it has seen a backward); this prices later steps.
- ``fsdp2`` (``FSDP2Sync``, ``fully_shard`` on every layer and then the root: ``L + 1`` units):
  one all-gather of each unit's parameters at the step's start and one reduce-scatter of each
  unit's gradients in the last backward: ``L + 1`` calls of each over all parameters.

With ``state_sharding='zero1'`` the ``allreduce`` and ``ddp`` modes also all-gather the updated
parameters (a sharded optimizer step); FSDP2 needs no such call (its parameters stay sharded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from costmodel.model_terms import inner, kv_inner, num_params
from costmodel.specs import DDP_DEFAULT_BUCKET_BYTES, ClusterSpec, ModelSpec

if TYPE_CHECKING:
    from costmodel.collectives import Collective

DDP_DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: DDP's first bucket at its default cap."""

BF16_BYTES = 2
FP32_BYTES = 4
ADAM_MOMENTS = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncCalls:
    """Calls of one collective in a step's gradient sync, over the whole world."""

    op: Collective
    """The collective (timed by ``costmodel.collectives.collective_time_s``)."""
    num_calls: int
    """Calls per step, each paying the collective's latency."""
    bytes_per_rank: float
    """Bytes summed over the calls, as ``collective_time_s`` takes them: an all-reduce's input,
    an all-gather's output, a reduce-scatter's input (the whole tensor on every rank)."""


def _tensors_1d(model: ModelSpec) -> list[int]:
    """1D (LLaMA, as the executor's reference model): the output head ``V*h``, the final norm
    ``h``, then from the last layer down: ``down f*h``, ``up h*f``, ``gate h*f``, norm ``h``,
    ``out h*h``, fused ``qkv h*(h + 2*h_kv)``, norm ``h``; the input embedding ``V*h`` last. Tied
    embeddings are one tensor (ready last)."""
    h, f = model.hidden, model.ffn_hidden
    layer = [f * h, h * f, h * f, h, inner(model) * h, h * (inner(model) + 2 * kv_inner(model)), h]
    head = [] if model.tied_embeddings else [model.vocab * h]
    if model.num_experts or model.attention_sinks:
        layers = [t for i in reversed(range(model.num_layers)) for t in _layer_tensors_mixed(model, i)]
        return [*head, h, *layers, model.vocab * h]
    return [*head, h, *layer * model.num_layers, model.vocab * h]


def _layer_tensors_mixed(model: ModelSpec, layer: int) -> list[int]:
    """One 1D layer of a MoE or sink model as transformers 5.24 holds it: a MoE layer's experts as
    two stacked tensors (``down E*h*f_e``, ``gate_up E*2f_e*h``), shared experts likewise, the router
    ``h*E``; a dense layer's three MLP matrices; the sinks ``heads``; then attention and norms."""
    h, f = model.hidden, model.ffn_hidden
    if model.num_experts and layer not in model.dense_mlp_layers:
        f_e, e, shared = model.expert_ffn_hidden or 0, model.num_experts, model.num_shared_experts
        mlp = [e * h * f_e, e * 2 * f_e * h, *([shared * h * f_e, shared * 2 * f_e * h] if shared else []), h * e]
    else:
        mlp = [f * h, h * f, h * f]
    sinks = [model.num_heads] if model.attention_sinks else []
    return [*mlp, h, *sinks, inner(model) * h, h * (inner(model) + 2 * kv_inner(model)), h]


def _tensors_2d(model: ModelSpec) -> list[int]:
    """2D (STDiT), per block from the last down: ``fc2 f*h``, ``fc1 h*f``, cross-attention out
    ``h*h``, kv ``2*h*h`` and q ``h*h``, self-attention out ``h*h`` and qkv ``3*h*h``, norms ``6*h``."""
    h, f = model.hidden, model.ffn_hidden
    return [f * h, h * f, h * h, 2 * h * h, h * h, h * h, 3 * h * h, 6 * h] * (2 * model.num_layers)


def _tensors_3d(model: ModelSpec) -> list[int]:
    """3D (a DiT block, as 1D's attention widths): the un-patching projection, then per block
    from the last down ``fc2``, ``fc1``, cross-attention (Wan) out, kv, q, self-attention out and
    qkv, norms and modulation ``6*h``; the patch embedding last. MMDiT (joint attention): the
    single-stream blocks, then the dual-stream blocks' two streams, each ``fc2``, ``fc1``, out,
    qkv, adaLN-Zero ``6*h*h`` and norms ``4*h``."""
    h, f = model.hidden, model.ffn_hidden
    qkv, out = h * (inner(model) + 2 * kv_inner(model)), inner(model) * h
    if model.joint_attention_tokens:
        stream = [f * h, h * f, out, qkv, 6 * h * h, 4 * h]
        single, dual = model.num_layers - model.dual_stream_layers, model.dual_stream_layers
        layers = [*stream * single, *stream * (2 * dual)]
    else:
        cross = [h * h, 2 * h * h, h * h] if model.cross_attention_tokens else []
        layers = [f * h, h * f, *cross, out, qkv, 6 * h] * model.num_layers
    outer = num_params(model) - sum(layers)  # patch embedding in and out
    return [outer // 2, *layers, outer - outer // 2]


PARAM_TENSORS: dict[str, Callable[[ModelSpec], list[int]]] = {
    "1d": _tensors_1d, "2d": _tensors_2d, "3d": _tensors_3d}
"""The parameter tensors of each model kind, in gradient-ready order (one row a kind, as
``costmodel.model_terms.KIND_TERMS``)."""


def param_tensor_elements(model: ModelSpec) -> list[int]:
    """Elements of each parameter tensor, in the order backward makes their gradients ready.

    The layout of ``costmodel.analytic.num_params`` (they add up to it), by kind
    (:data:`PARAM_TENSORS`).
    """
    return PARAM_TENSORS[model.kind](model)


def ddp_num_buckets(tensor_bytes: Sequence[float], *, bucket_bytes: int) -> int:
    """DDP's buckets after its rebuild: tensors (in gradient-ready order) fill the open bucket,
    which closes at ``>=`` its limit (1 MiB for the first at DDP's default cap, else the cap)."""
    first = DDP_DEFAULT_FIRST_BUCKET_BYTES if bucket_bytes == DDP_DEFAULT_BUCKET_BYTES else bucket_bytes
    closed, filled, limit = 0, 0.0, first
    for size in tensor_bytes:
        filled += size
        if filled >= limit:
            closed, filled, limit = closed + 1, 0.0, bucket_bytes
    return closed + (1 if filled > 0 or closed == 0 else 0)


def sync_calls(cluster: ClusterSpec, *, model: ModelSpec, num_params: int, grad_bytes_per_param: float
               ) -> tuple[SyncCalls, ...]:
    """The collectives of one step's gradient sync under ``cluster.grad_sync``.

    Args:
        cluster: The world, its sync mode and state sharding.
        model: The architecture (layers ``L``: FSDP2 shards ``L + 1`` units, each layer and the
            root; parameter tensors: DDP's buckets).
        num_params: Parameters of the model (the cost-model file's count).
        grad_bytes_per_param: Bytes of a gradient (and of a training-dtype parameter) element.

    Returns:
        One entry per collective kind, in the order the step issues them.
    """
    grad_bytes = num_params * grad_bytes_per_param
    if cluster.grad_sync == "fsdp2":
        units = model.num_layers + 1
        return (SyncCalls(op="allgather", num_calls=units, bytes_per_rank=grad_bytes),
                SyncCalls(op="reducescatter", num_calls=units, bytes_per_rank=grad_bytes))
    buckets = 1
    if cluster.grad_sync == "ddp":
        sizes = [n * grad_bytes_per_param for n in param_tensor_elements(model)]
        buckets = ddp_num_buckets(sizes, bucket_bytes=cluster.ddp_bucket_bytes)
    calls = [SyncCalls(op="allreduce", num_calls=buckets, bytes_per_rank=grad_bytes)]
    if cluster.state_sharding == "zero1":
        calls.append(SyncCalls(op="allgather", num_calls=1, bytes_per_rank=grad_bytes))
    return tuple(calls)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStateBytes:
    """Model-state bytes one rank holds at its peak in a step (bf16 training, fp32 Adam) [R20]."""

    params_bytes: float
    """bf16 parameters the forward and backward use (FSDP2: unsharded over the whole step)."""
    grads_bytes: float
    """bf16 gradients accumulated over the micro-batches (DDP: plus its bucket buffers)."""
    fp32_state_bytes: float
    """fp32 master parameters and the two Adam moments (sharded under zero1 and FSDP2)."""

    @property
    def master_bytes(self) -> float:
        """The master parameters' share of ``fp32_state_bytes`` (4 of its 12 bytes a parameter)."""
        return self.fp32_state_bytes * FP32_BYTES / ((1 + ADAM_MOMENTS) * FP32_BYTES)

    @property
    def total_bytes(self) -> float:
        """All of them."""
        return self.params_bytes + self.grads_bytes + self.fp32_state_bytes


def model_state(cluster: ClusterSpec, *, num_params: int) -> ModelStateBytes:
    """Model states per rank under the cluster's sync mode and state sharding.

    With ``p`` parameters and ``n`` ranks (``s = 1`` replicated, ``s = n`` zero1):

    - allreduce: ``2p`` params + ``2p`` grads + ``(4p + 8p) / s`` master and moments (16p
      replicated, ``4p + 12p/n`` zero1, as before the modes existed).
    - ddp: the same plus ``2p`` for DDP's bucket buffers, a second gradient copy unless
      ``ddp_gradient_as_bucket_view`` (then the gradients are views into them).
    - fsdp2: ``2p + 2p + (4p + 8p) / n``. The executor all-gathers every unit at the step's
      start and keeps the unsharded parameters and their unsharded, accumulated gradients until
      the last backward; the sharded fp32 parameters are the master weights and the moments are
      sharded. The sharded fp32 gradient (``4p/n``) appears only as each unit's reduce-scatter
      frees that unit's unsharded parameters and gradients (4 bytes per parameter), so it never
      raises the peak. FSDP2 pads each parameter's first dimension to a multiple of ``n``
      (not counted: at most ``n - 1`` rows per parameter).
    """
    p = float(num_params)
    n = cluster.num_gpus
    shards = 1 if cluster.state_sharding == "replicated" else n
    grads = BF16_BYTES * p
    if cluster.grad_sync == "ddp" and not cluster.ddp_gradient_as_bucket_view:
        grads += BF16_BYTES * p
    return ModelStateBytes(params_bytes=BF16_BYTES * p, grads_bytes=grads,
                           fp32_state_bytes=(1 + ADAM_MOMENTS) * FP32_BYTES * p / shards)
