"""The memory part of :class:`costmodel.evaluate.CostModel`: bytes per rank of model states,
working buffers and a micro-batch's samples.

Memory of a micro-batch is additive over its samples: each sample's kept activations (a fully
checkpointed sample also one rematerialised layer, see :meth:`MemoryCosts.activation_bytes`) and
the transient working set of a layer's backward per token: the peak the executor reaches. Under a
Ulysses x ring layout each sample adds the ring's key/value buffers
(:func:`costmodel.ring.timing.ring_kv_buffer_bytes`), token working memory linear in its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.expert_costs import expert_model_state
from costmodel.grad_sync import ModelStateBytes, model_state
from costmodel.part import CostModelPart
from costmodel.ring.layout import GroupLayout
from costmodel.schema import CostModelFile
from costmodel.specs import Sample

FloatArray = NDArray[np.float64]


def reserved_fraction(safety_fraction: float, margin: float) -> float:
    """Share of the activation budget kept free under a safety fraction and a fit's margin ``m``:
    the larger of the fraction and ``m/(1 + m)`` (activations up to ``1 + m`` times the
    prediction fit in the rest), never their sum."""
    return max(safety_fraction, margin / (1.0 + margin))


class MemoryCosts(CostModelPart):
    """Memory of a cost model bound to a cluster (a mixin of ``CostModel``)."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by CostModel
        def kv_replicas(self, group_size: int) -> int: ...

        def kv_bytes_per_token(self, ulysses_degree: int) -> float: ...

        @staticmethod
        def _alltoall_group(group_size: int, num_nodes: int | None, layout: GroupLayout | None
                            ) -> tuple[int, int | None]: ...

    def model_state(self) -> ModelStateBytes:
        """Model states per rank by kind (:func:`costmodel.grad_sync.model_state`)."""
        if self.cluster.expert_parallel_size > 1:
            return expert_model_state(self.file, self.cluster)
        return model_state(self.cluster, num_params=self.file.num_params)

    def model_state_bytes(self) -> float:
        """Model states per rank at their peak in a step under the cluster's sync mode: bf16
        params and grads, fp32 master weights and Adam moments replicated or sharded [R20]."""
        return self.model_state().total_bytes

    def activation_bytes(self, tokens: ArrayLike, *, group_size: int, recompute_layers: ArrayLike = 0,
                         layout: GroupLayout | None = None) -> FloatArray:
        """Peak bytes one rank holds for samples under a policy (additive per sample).

        ``s/d * (k*full + max((L-k)*none + max([k<L]*transient, head_transient), [k>0]*recomputed)
        + working + [u>1]*alltoall_buffers)`` (the all-to-all buffers only where a Ulysses group of
        ``u > 1`` ranks runs): backward runs from the last layer down, the head's and loss's first (on top of
        every kept layer, with ``head_transient``), then the ``L-k`` plain layers (each with the
        layer's ``transient`` on top of what is still kept), then the ``k`` checkpointed ones,
        each rematerialising its activations only after the plain layers above it have freed
        theirs: it holds ``recomputed`` bytes per token (``recomputed_layer_bytes_per_token``,
        fitted from peaks; by default ``none + max(transient, head_transient)``, the
        rematerialised layer on top of the transient, which then adds to the peak only when every
        layer is checkpointed, ``k = L``, dominated by ``k = L-1``). ``none`` and ``recomputed``
        grow by ``kv_head_bytes_per_token_layer`` per replicated key/value head (:meth:`kv_replicas`).
        Summed over a micro-batch with mixed policies this bounds the peak from above and is exact
        when they agree. Under a ring layout (``u x r``) the key/value replication is the Ulysses
        subgroup's (``kv_replicas(u)``) and each sample adds the ring's key/value buffers,
        ``4 s/r`` tokens of this rank's key/value heads (:func:`costmodel.ring.timing.ring_kv_buffer_bytes`,
        linear in the tokens, so additive as the rest). A joint-attention (MMDiT) model's sample
        adds its ``J`` text tokens, whole on every rank of the group (``executor/joint.py``):
        ``J * (max(L-k, [k>0])*none + k*full)``, per sample and not divided by ``d``; so does what
        a plain layer keeps per sample whatever its tokens (``bytes_per_sample_layer_none``: the
        cross-attention keys and values of the sample's text), ``max(L-k, [k>0])`` times.
        """
        u, _ = self._alltoall_group(group_size, None, layout)
        s = np.asarray(tokens, dtype=np.float64)
        k = np.asarray(recompute_layers, dtype=np.float64)
        a = self.file.activation
        layers = self.num_layers
        kept_none_layers = np.maximum(layers - k, np.where(k > 0, 1.0, 0.0))
        kv = a.kv_head_bytes_per_token_layer * self.kv_replicas(u)
        none = a.bytes_per_token_layer_none + kv
        transient = np.where(k < layers, max(a.transient_bytes_per_token, a.head_transient_bytes_per_token),
                             a.head_transient_bytes_per_token)
        recomputed = (none + max(a.transient_bytes_per_token, a.head_transient_bytes_per_token)
                      if a.recomputed_layer_bytes_per_token is None else a.recomputed_layer_bytes_per_token + kv)
        # the all-to-all's send and receive buffers exist only where a Ulysses group of several runs
        buffers = a.alltoall_buffer_bytes_per_token if u > 1 else 0.0
        per_token = (k * a.bytes_per_token_layer_full + a.working_bytes_per_token + buffers
                     + np.maximum((layers - k) * none + transient, np.where(k > 0, recomputed, 0.0)))
        ring = self.ring_buffer_bytes(s, layout=layout)
        # joined text tokens (MMDiT): kept per layer like tokens, whole on every rank of the group
        text = self.file.model.joint_attention_tokens * (kept_none_layers * none + k * a.bytes_per_token_layer_full)
        # per sample (cross-attention keys and values of its text): whole on every rank of the group
        per_sample = kept_none_layers * a.bytes_per_sample_layer_none
        return np.asarray(s / group_size * per_token + ring + text + per_sample, dtype=np.float64)

    def ring_buffer_bytes(self, tokens: ArrayLike, *, layout: GroupLayout | None) -> FloatArray:
        """Per sample, the ring's key/value buffers one rank holds while the sample's attention runs
        (token working memory, not kept for backward): ``4 s/r`` tokens of the key/value heads the
        rank holds after the Ulysses swap, at :attr:`element_bytes` (= :func:`costmodel.ring.timing.
        ring_kv_buffer_bytes` per sample); 0 for pure Ulysses (``layout`` None or ``r = 1``)."""
        s = np.asarray(tokens, dtype=np.float64)
        if layout is None or layout.ring_degree == 1:
            return np.zeros_like(s)
        return np.asarray(4.0 * s / layout.ring_degree * self.kv_bytes_per_token(layout.ulysses_degree),
                          dtype=np.float64)

    def fixed_working_bytes(self) -> float:
        """Working memory of any micro-batch: the fixed buffers, the per-layer ones and the
        chunked loss's one chunk of logits (held on top of every kept activation when the loss
        runs, before the layers' backward)."""
        a = self.file.activation
        return a.fixed_working_bytes + self.num_layers * a.fixed_working_bytes_per_layer + a.loss_chunk_bytes

    def fixed_bytes(self) -> float:
        """Per-rank memory independent of the batch: model states and working buffers."""
        return self.model_state_bytes() + self.fixed_working_bytes()

    def reserved_budget_fraction(self, safety_fraction: float) -> float:
        """Share of the activation budget a plan keeps free: the planner's ``safety_fraction`` or,
        when larger, what the file's ``memory_margin_fraction`` ``m`` needs (activations up to
        ``1 + m`` times the prediction fit in ``1 - m/(1 + m)`` of the budget), never both."""
        return reserved_fraction(safety_fraction, self.file.activation.memory_margin_fraction)

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


def kept_bytes(file: CostModelFile, tokens: float, *, recompute_layers: int, num_layers: int | None = None) -> float:
    """Bytes a stack of ``num_layers`` layers (default: the model's) keeps for backward at the end of
    one sample's forward on a rank of its own, the first ``recompute_layers`` checkpointed:
    ``(s + J) * ((n-k)*none + k*full) + (n-k)*per_sample`` (``J`` the joined text tokens). What
    :meth:`MemoryCosts.activation_bytes` holds before the backward's working set and the layer a
    checkpointed sample rematerialises.

    Raises:
        ValueError: for ``recompute_layers`` outside ``[0, num_layers]``.
    """
    n = file.model.num_layers if num_layers is None else num_layers
    if not 0 <= recompute_layers <= n:
        raise ValueError(f"recompute_layers={recompute_layers} not in [0, {n}]")
    a = file.activation
    per_token = (n - recompute_layers) * a.bytes_per_token_layer_none + recompute_layers * a.bytes_per_token_layer_full
    return float((tokens + file.model.joint_attention_tokens) * per_token
                 + (n - recompute_layers) * a.bytes_per_sample_layer_none)
