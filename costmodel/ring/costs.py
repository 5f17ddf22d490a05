"""The ring part of :class:`costmodel.evaluate.CostModel`: what a Ulysses x ring group adds.

A group that splits attention as Ulysses over ``u`` ranks x ring over ``r`` rank-sets
(:class:`costmodel.ring.layout.GroupLayout`) keeps every per-token and per-pair compute term at
its size ``d = u r`` (the ring's steps add up to the ``s^2/d`` pairs, ``costmodel/evaluate.py``),
runs its all-to-alls over the ``u`` ranks of a Ulysses subgroup, and adds what the ring costs
beyond that (:func:`costmodel.ring.timing.ring_attention_time_s`: its blocks' lower efficiency,
the unhidden share of its hops, its per-step cost and its merges) for every layer call of the
micro-batch, the recomputed ones included (:meth:`RingCosts.ring_exposed_s`: not additive over
samples, since a hop carries the whole call's block). The hops carry keys and values at the
file's element size (:attr:`RingCosts.element_bytes`); the ring's coefficients are the file's
(fitted) or the published defaults (:attr:`RingCosts.ring_coefficients`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike, NDArray

from costmodel.layer_mix import window_pairs
from costmodel.part import CostModelPart
from costmodel.ring.layout import GroupLayout
from costmodel.ring.timing import (
    RingLayerTime,
    StepSeconds,
    calls_exposed_s,
    default_p2p_links,
    kv_bytes_per_token,
    microbatches_exposed_s,
    reduce_columns,
    ring_attention_time_s,
    ring_steps_s,
)
from costmodel.ring.window import hop_tokens, remote_steps
from costmodel.schema import P2PLinks, RingCoefficients

FloatArray = NDArray[np.float64]

WINDOW_COLUMNS = 11
"""Columns of a sample under a model with sliding-window layers (:meth:`RingCosts._ring_columns`);
5 without: tokens and the full layers' four weighted pairs."""


class RingCosts(CostModelPart):
    """Ring attention costs of a cost model bound to a cluster (a mixin of ``CostModel``)."""

    __slots__ = ()

    if TYPE_CHECKING:  # provided by CostModel
        def _alltoall_per_pass(self, group_size: int, num_nodes: int | None) -> tuple[float, float]: ...

    @property
    def element_bytes(self) -> float:
        """Bytes of one key or value element as the model trains: the file's gradient element size
        (``comm.grad_bytes_per_param``: the profile's dtype for a fitted file, ``dcp fit``; bf16 for
        the analytic one), so an fp32 CPU-fitted model's ring blocks and buffers are fp32."""
        return float(self.file.comm.grad_bytes_per_param)

    def kv_bytes_per_token(self, ulysses_degree: int) -> float:
        """Keys and values of one token for the heads a rank holds after the Ulysses swap over
        ``ulysses_degree`` ranks (:func:`costmodel.ring.timing.kv_bytes_per_token`) at
        :attr:`element_bytes`."""
        return kv_bytes_per_token(self.file.model, ulysses_degree=ulysses_degree, element_bytes=self.element_bytes)

    @property
    def p2p_links(self) -> P2PLinks:
        """The ring's p2p links: the file's (fitted), else (or for an unmeasured inter-node link)
        the hardware's analytic ones (:func:`costmodel.ring.timing.default_p2p_links`)."""
        p2p = self.file.comm.p2p
        if p2p is not None and p2p.inter is not None:
            return p2p
        default = default_p2p_links(self.cluster.hardware)
        return default if p2p is None else p2p.model_copy(update={"inter": default.inter})

    @property
    def ring_coefficients(self) -> RingCoefficients:
        """How ring steps run: the file's (fitted), else the published defaults."""
        return self.file.comm.ring if self.file.comm.ring is not None else RingCoefficients()

    def _charged_multipliers(self, tokens: FloatArray, group_size: int) -> tuple[FloatArray, FloatArray]:
        """Time multipliers the per-sample terms charge each sample's attention at (its kernel over
        the whole sample: the curve at ``s``, or the Hockney factor of ``s/d`` tokens per rank)."""
        c = self.file.compute
        curves = c.attention_efficiency
        if curves is not None:
            return curves.forward.time_multiplier(tokens), curves.backward.time_multiplier(tokens)
        hockney = 1.0 + c.attention_half_tokens * group_size / tokens
        return hockney, hockney

    def _block_multipliers(self, tokens: FloatArray, layout: GroupLayout) -> tuple[FloatArray, FloatArray]:
        """Time multipliers of a ring step's kernel on each sample's ``s/r``-token block: the
        attention curve at the block's length (or the Hockney factor), times the ring's own block
        term ``1 + block_half_tokens / (s/r)``."""
        r = layout.ring_degree
        c = self.file.compute
        extra = 1.0 + self.ring_coefficients.block_half_tokens * r / tokens
        curves = c.attention_efficiency
        if curves is not None:
            block = tokens / r
            return curves.forward.time_multiplier(block) * extra, curves.backward.time_multiplier(block) * extra
        hockney = 1.0 + c.attention_half_tokens * layout.group_size / tokens
        return hockney * extra, hockney * extra

    def _ring_kwargs(self, layout: GroupLayout, links: P2PLinks | None = None) -> dict[str, object]:
        u = layout.ulysses_degree
        model = self.file.model
        return dict(kv_bytes_per_token=self.kv_bytes_per_token(u),
                    query_channels=model.num_heads // u * model.head_size,
                    links=self.p2p_links if links is None else links, crosses_nodes=layout.ring_crosses_nodes,
                    hbm_bytes_per_s=self.cluster.hardware.hbm_bandwidth_bytes_per_s, ring=self.ring_coefficients)

    def ring_layer_time(self, tokens: Sequence[float], *, layout: GroupLayout,
                        links: P2PLinks | None = None, additive_only: bool = False,
                        sliding: bool = False) -> RingLayerTime:
        """One layer's attention and its all-to-alls on one rank of a ``u x r`` group, per pass
        (``sliding``: a sliding-window layer of the model, which runs only the steps its window
        needs).

        The ring from :func:`costmodel.ring.timing.ring_attention_time_s` with this file's attention
        coefficients (``compute.forward/backward.per_attn_pair`` and their efficiency), its ring
        coefficients (:attr:`ring_coefficients`), the model's heads, the hardware's HBM bandwidth
        and ``links`` (default :attr:`p2p_links`; ``additive_only``: the form that bounds a sample's
        share from below); the all-to-alls as this cost model charges a Ulysses subgroup of ``u``
        (``sum s_i / d`` tokens per rank).
        """
        u, r = layout.ulysses_degree, layout.ring_degree
        window = self.file.model.sliding_window
        if sliding and window is None:
            raise ValueError(f"model {self.file.model.name!r} has no sliding_window: no sliding layer to time")
        forward, backward, exp_f, exp_b = ring_attention_time_s(
            tokens, ulysses_degree=u, ring_degree=r, window=window if sliding else None,
            forward_s_per_pair=self.file.compute.forward.per_attn_pair,
            backward_s_per_pair=self.file.compute.backward.per_attn_pair,
            block_multipliers=lambda s: self._block_multipliers(s, layout),
            charged_multipliers=lambda s: self._charged_multipliers(s, layout.group_size),
            additive_only=additive_only, **self._ring_kwargs(layout, links))  # type: ignore[arg-type]
        alpha, per_token = self._alltoall_per_pass(u, layout.alltoall_nodes)
        a2a = alpha + per_token * math.fsum(tokens) / layout.group_size if u > 1 else 0.0
        return RingLayerTime(forward_s=forward, backward_s=backward, exposed_forward_s=exp_f,
                             exposed_backward_s=exp_b, alltoall_forward_s=a2a)

    def _ring_columns(self, tokens: FloatArray, layout: GroupLayout) -> FloatArray:
        """Per sample what a call's ring depends on: its tokens and, per layer type, its pairs on
        one rank weighted by the four multipliers (block forward, block backward, charged forward,
        charged backward), additive over a call's samples (:func:`reduce_columns`); a model with
        sliding-window layers adds their windowed pairs (:func:`costmodel.layer_mix.window_pairs`)
        and the tokens a needed step brings (:func:`costmodel.ring.window.hop_tokens`) and, last,
        the remote steps the sample's window needs
        (:func:`costmodel.ring.window.remote_steps`), which a call reduces by its maximum."""
        u, r = layout.ulysses_degree, layout.ring_degree
        bf, bb = self._block_multipliers(tokens, layout)
        cf, cb = self._charged_multipliers(tokens, layout.group_size)
        pairs = tokens * tokens / (u * r)
        columns = [tokens, pairs * bf, pairs * bb, pairs * cf, pairs * cb]
        model = self.file.model
        if model.num_sliding_layers and model.sliding_window is not None:
            slide = window_pairs(tokens, model.sliding_window) / (u * r)
            hop = hop_tokens(tokens, window=model.sliding_window, ring_degree=r)
            remote = remote_steps(tokens, window=model.sliding_window, ring_degree=r).astype(np.float64)
            columns += [slide * bf, slide * bb, slide * cf, slide * cb, hop, remote]
        return np.stack(columns, axis=-1)

    def _exposed_from_columns(self, sums: FloatArray, layout: GroupLayout, *, additive_only: bool = False,
                              compute_weight: float = 1.0) -> tuple[FloatArray, FloatArray]:
        """Exposed ``(forward, backward)`` of one layer's ring per call from its reduced columns,
        averaged over the layer mix: full layers run all ``r`` steps, sliding-window ones the
        local block and the remote steps the call needs, each layer's pairs split over its steps
        (``additive_only`` and ``compute_weight``: :func:`costmodel.ring.timing.ring_steps_s`)."""
        r = layout.ring_degree
        model = self.file.model
        kwargs = self._ring_kwargs(layout)
        block_tokens = sums[..., 0] / r

        def exposed(first: int, run: FloatArray | float, hop: FloatArray | None = None
                    ) -> tuple[FloatArray, FloatArray]:
            fwd, bwd = self.file.compute.forward.per_attn_pair, self.file.compute.backward.per_attn_pair
            steps = StepSeconds(forward=fwd * sums[..., first] / run, backward=bwd * sums[..., first + 1] / run,
                                forward_charged=fwd * sums[..., first + 2] / run,
                                backward_charged=bwd * sums[..., first + 3] / run)
            run_steps = np.asarray(run, dtype=np.float64)
            _, _, exp_f, exp_b = ring_steps_s(steps, block_tokens, ring_degree=r, additive_only=additive_only,
                                              compute_weight=compute_weight, steps_run=run_steps,
                                              hop_tokens=hop, **kwargs)  # type: ignore[arg-type]
            return np.asarray(exp_f, dtype=np.float64), np.asarray(exp_b, dtype=np.float64)

        full_f, full_b = exposed(1, float(r))
        sliding = model.num_sliding_layers if sums.shape[-1] == WINDOW_COLUMNS else 0
        if not sliding:
            return full_f, full_b
        slide_f, slide_b = exposed(5, 1.0 + sums[..., 10], sums[..., 9])
        full = model.num_layers - sliding
        return ((full * full_f + sliding * slide_f) / model.num_layers,
                (full * full_b + sliding * slide_b) / model.num_layers)

    def ring_alone_exposed_s(self, tokens: ArrayLike, *, layout: GroupLayout, additive_only: bool = False,
                             weights: ArrayLike | None = None) -> tuple[FloatArray, FloatArray]:
        """``(forward, backward)`` exposed seconds of one layer's ring for each sample alone in a
        call (:meth:`ring_layer_time` of ``[s]``, vectorised).

        ``additive_only``: each sample's share of any call it is in, from below
        (:func:`costmodel.ring.timing.ring_steps_s`): of the compute-bound and the hop-bound form,
        per pass the one with the larger total over the samples weighted by ``weights`` (e.g. how
        many samples of each length a batch has; default one each). One form holds for every
        sample, so the shares of any call's samples still sum under its exposed seconds."""
        s = np.asarray(tokens, dtype=np.float64)
        columns = self._ring_columns(s, layout)
        if not additive_only:
            return self._exposed_from_columns(columns, layout)
        w = np.ones_like(s) if weights is None else np.asarray(weights, dtype=np.float64)
        compute_f, compute_b = self._exposed_from_columns(columns, layout, additive_only=True, compute_weight=1.0)
        hop_f, hop_b = self._exposed_from_columns(columns, layout, additive_only=True, compute_weight=0.0)
        forward = compute_f if float(w @ compute_f) >= float(w @ hop_f) else hop_f
        backward = compute_b if float(w @ compute_b) >= float(w @ hop_b) else hop_b
        return forward, backward

    def ring_exposed_s(self, tokens: Sequence[float], recompute_layers: Sequence[int], *,
                       layout: GroupLayout) -> float:
        """Seconds a micro-batch's rings add to its compute: every layer call's exposed forward and
        backward (:meth:`ring_layer_time`), the recomputed forwards again
        (:func:`costmodel.ring.timing.calls_exposed_s`); 0 for a pure Ulysses layout."""
        if layout.ring_degree == 1:
            return 0.0

        def exposed(call_tokens: list[float]) -> tuple[float, float]:
            columns = self._ring_columns(np.asarray(call_tokens, dtype=np.float64), layout)
            sums = reduce_columns(columns, max_columns=int(columns.shape[-1] == WINDOW_COLUMNS))
            f, b = self._exposed_from_columns(sums, layout)
            return float(f), float(b)

        return calls_exposed_s(tokens, recompute_layers, num_layers=self.num_layers, exposed=exposed)

    def ring_exposed_many_s(self, tokens: ArrayLike, recompute_layers: ArrayLike, starts: ArrayLike, *,
                            layout: GroupLayout) -> FloatArray:
        """:meth:`ring_exposed_s` of many micro-batches of one layout at once (the samples of all of
        them in order, ``starts``: each micro-batch's first offset), vectorised over the layer calls
        (:func:`costmodel.ring.timing.microbatches_exposed_s`; a planner evaluates thousands)."""
        num_mbs = len(np.asarray(starts))
        if layout.ring_degree == 1:
            return np.zeros(num_mbs)
        columns = self._ring_columns(np.asarray(tokens, dtype=np.float64), layout)
        return microbatches_exposed_s(columns, np.asarray(recompute_layers), np.asarray(starts),
                                      num_layers=self.num_layers,
                                      max_columns=int(columns.shape[-1] == WINDOW_COLUMNS),
                                      exposed=lambda sums: self._exposed_from_columns(sums, layout))
