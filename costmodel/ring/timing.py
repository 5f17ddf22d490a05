"""Time and memory of ring attention on one rank: the pure functions, no cost model.

The one definition of a ring's cost: :mod:`costmodel.evaluate` prices ``u x r`` groups with it
(:mod:`costmodel.ring.costs`). On one rank, per layer and pass, for a micro-batch of samples of
``s_i`` tokens in a group of ``d = u x r``:

* every ring step attends the rank's queries (``sum s_i / r`` tokens, ``H/u`` heads) to one
  key/value block; with the zig-zag chunks (``executor/ring_layout.py``) every step does the same
  share of the pairs, ``sum s_i^2 / (u r^2)`` (the ``r`` steps add up to the ``s^2/d`` a Ulysses
  group of ``d`` computes), each sample's at the efficiency of its ``s_i/r``-token block (the
  attention curve read at the block's length, or ``RingCoefficients.block_half_tokens``), where
  the per-sample terms charge the whole sample's kernel;
* a hop moves one block of ``sum s_i / r`` tokens' keys and values for this rank's key/value
  heads (``max(H_kv/u, 1)``: past ``H_kv`` Ulysses replicates a head, :mod:`costmodel.specs`); it
  is posted beside the step's attention, and a step takes ``max(compute, hop) + exposed_fraction
  * min(compute, hop) + step_overhead_s`` (:func:`step_s`, :class:`costmodel.schema.RingCoefficients`);
  ``r - 1`` such steps, then the last block's step without a hop, then ``r - 1`` log-sum-exp merges
  of the running output (``merge_bytes_per_channel`` per query and head channel at the HBM
  bandwidth). Backward sends keys and values and their gradients (twice the bytes) per step and
  the gradients' last hop home.

A sliding-window layer runs only the steps whose blocks some local query's window reaches
(:mod:`costmodel.ring.window`): the local block and ``n - 1`` remote ones, its windowed pairs split
evenly over them, ``n - 1`` hops of only the keys the window reaches and ``n - 1`` merges;
:mod:`costmodel.ring.costs` averages full and windowed layers over the model's layer mix.

A p2p transfer costs ``alpha + bytes / bandwidth`` (:func:`p2p_time_s`) on an intra-node or an
inter-node link (:class:`costmodel.schema.P2PLinks`). Memory: the ring holds the block in hand
and the one arriving (forward), keys, values and their gradients of both (backward):
:func:`ring_kv_buffer_bytes` per rank, transient on top of the Ulysses working set.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.layer_mix import window_pairs
from costmodel.ring.window import call_remote_steps, check_window, hop_tokens
from costmodel.schema import LinkFit, P2PLinks, RingCoefficients
from costmodel.specs import HardwareSpec, ModelSpec

KV_ELEMENT_BYTES = 2.0
"""Bytes of one key or value element on the wire and in the ring's buffers (bf16)."""


def p2p_time_s(links: P2PLinks, bytes_per_hop: float | np.ndarray, *, crosses_nodes: bool) -> np.ndarray:
    """Seconds of one hop of ``bytes_per_hop`` bytes: ``alpha + bytes / bandwidth``."""
    link = links.link(crosses_nodes=crosses_nodes)
    return np.asarray(link.alpha_s + np.asarray(bytes_per_hop, dtype=np.float64) / link.bytes_per_s)


def default_p2p_links(hardware: HardwareSpec, *, alpha_intra_s: float = 10e-6,
                      alpha_inter_s: float = 20e-6) -> P2PLinks:
    """Unfitted links from the hardware's public bandwidths (NVLink per direction inside a node,
    the per-GPU network across nodes); the latencies are placeholders of the order NCCL's p2p
    has, to be replaced by ``costmodel.ring.fit_p2p`` on ``dcp profile-comm`` records."""
    return P2PLinks(
        intra=LinkFit(placement="intra", group_size=2, num_nodes=1, alpha_s=alpha_intra_s,
                      bytes_per_s=hardware.nvlink_bytes_per_s_per_direction),
        inter=LinkFit(placement="inter", group_size=2, num_nodes=2, alpha_s=alpha_inter_s,
                      bytes_per_s=hardware.network_bytes_per_s_per_gpu))


def kv_bytes_per_token(model: ModelSpec, *, ulysses_degree: int, element_bytes: float = KV_ELEMENT_BYTES) -> float:
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


Multipliers = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``f(tokens of each sample) -> (forward, backward)`` time multipliers of their attention kernels
over the pair coefficients (the efficiency curve's ``max / efficiency``; ones for none)."""


def _ones(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.ones_like(s), np.ones_like(s)


def ring_attention_time_s(tokens: Sequence[int] | Sequence[float], *, ulysses_degree: int, ring_degree: int,
                          forward_s_per_pair: float, backward_s_per_pair: float, kv_bytes_per_token: float,
                          query_channels: int, links: P2PLinks, crosses_nodes: bool,
                          hbm_bytes_per_s: float, ring: RingCoefficients | None = None,
                          block_multipliers: Multipliers | None = None,
                          charged_multipliers: Multipliers | None = None,
                          additive_only: bool = False, window: int | None = None
                          ) -> tuple[float, float, float, float]:
    """``(forward, backward, exposed forward, exposed backward)`` seconds of one layer's ring.

    Under a sliding ``window`` the ring runs only the steps whose blocks some query's window
    reaches (:func:`costmodel.ring.window.call_remote_steps`, zig-zag chunks, on the busiest
    position) and the rank's windowed pairs (``window_pairs / (u r)``) are split evenly over them.

    Args:
        tokens: Tokens of each sample of the micro-batch (or of one layer call's samples).
        ulysses_degree: ``u``.
        ring_degree: ``r``.
        forward_s_per_pair: Seconds per (query, key) pair of a forward on one GPU (all heads), at the
            attention kernel's best efficiency.
        backward_s_per_pair: The same for the backward.
        kv_bytes_per_token: Key and value bytes of one token for this rank's heads.
        query_channels: Heads x head size of this rank's queries (``H/u x Dh``).
        links: The p2p links.
        crosses_nodes: Whether the ring's hops cross nodes.
        hbm_bytes_per_s: Memory bandwidth (merges).
        ring: How the steps run (default: the published defaults, ``RingCoefficients()``).
        block_multipliers: Time multipliers of a step's kernel on each sample's block (``s/r``
            tokens); default ones.
        charged_multipliers: Those the per-sample terms already charge the sample's attention at (a
            Ulysses kernel over ``s``); the exposed seconds are what the ring adds to them.
        additive_only: Expose only what is additive over samples and so bounds a sample's share
            from below (:func:`ring_steps_s`, compute-bound form): the blocks' lower efficiency,
            the exposed fraction of each hop's bytes, the merges (forward), the bytes of the
            gradients' hop home (backward); no latency, no per-step cost. For lower bounds.
        window: A sliding-window layer's window in tokens (None: full attention, every step).

    Raises:
        ValueError: for a degree below 1, a non-positive sample or window.
    """
    u, r = ulysses_degree, ring_degree
    s = np.asarray(tokens, dtype=np.float64)
    if u < 1 or r < 1 or (s <= 0).any():
        raise ValueError(f"need u, r >= 1 and positive tokens; got u={u}, r={r}, tokens={list(tokens)}")
    check_window(window)
    if window is None:
        run, per_step, hop = float(r), s**2 / (u * r * r), float(s.sum()) / r
    else:
        run = 1.0 + call_remote_steps(s, window=window, ring_degree=r)
        per_step = window_pairs(s, window) / (u * r * run)
        hop = float(hop_tokens(s, window=window, ring_degree=r).sum())
    block_f, block_b = (block_multipliers or _ones)(s)
    charged_f, charged_b = (charged_multipliers or _ones)(s)
    out = ring_steps_s(StepSeconds(
        forward=np.asarray(forward_s_per_pair * float((per_step * block_f).sum())),
        backward=np.asarray(backward_s_per_pair * float((per_step * block_b).sum())),
        forward_charged=np.asarray(forward_s_per_pair * float((per_step * charged_f).sum())),
        backward_charged=np.asarray(backward_s_per_pair * float((per_step * charged_b).sum()))),
        np.asarray(float(s.sum()) / r), ring_degree=r, kv_bytes_per_token=kv_bytes_per_token,
        query_channels=query_channels, links=links, crosses_nodes=crosses_nodes, hbm_bytes_per_s=hbm_bytes_per_s,
        ring=ring or RingCoefficients(), additive_only=additive_only, steps_run=np.asarray(run),
        hop_tokens=np.asarray(hop))
    return float(out[0]), float(out[1]), float(out[2]), float(out[3])


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSeconds:
    """Seconds of one ring step's attention per call (arrays, one entry per call)."""

    forward: np.ndarray
    """The forward kernel on its block, at the block's efficiency."""
    backward: np.ndarray
    """The backward kernel on its block."""
    forward_charged: np.ndarray
    """What the per-sample terms charge for a step's share of the forward (``1/r`` of the sample's
    attention at the efficiency of a Ulysses kernel over the whole sample)."""
    backward_charged: np.ndarray
    """The same for the backward."""


def step_s(compute_s: np.ndarray, hop_s: np.ndarray, ring: RingCoefficients) -> np.ndarray:
    """One ring step of ``compute_s`` attention with a hop of ``hop_s`` posted beside it:
    ``max(c, h) + exposed_fraction * min(c, h) + step_overhead_s``."""
    return np.asarray(np.maximum(compute_s, hop_s) + ring.exposed_fraction * np.minimum(compute_s, hop_s)
                      + ring.step_overhead_s, dtype=np.float64)


def ring_steps_s(steps: StepSeconds, block_tokens: np.ndarray, *, ring_degree: int, kv_bytes_per_token: float,
                 query_channels: int, links: P2PLinks, crosses_nodes: bool, hbm_bytes_per_s: float,
                 ring: RingCoefficients, additive_only: bool = False, compute_weight: float = 1.0,
                 steps_run: np.ndarray | None = None, hop_tokens: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`ring_attention_time_s` from each call's step seconds and block tokens (arrays: one
    entry per call, e.g. every sample alone), the one formula of a ring's steps: of the ``n``
    steps that run (``steps_run``, default all ``r``; fewer in a sliding-window layer,
    :mod:`costmodel.ring.window`), ``n - 1`` steps with a hop (:func:`step_s`; backward hops carry
    keys, values and their gradients, twice the bytes), the last block's step without one,
    ``n - 1`` merges (forward) and, when a block travelled, the gradients' hop home (backward).
    The per-sample terms charge ``n`` times a step's charged seconds. A hop carries ``hop_tokens``
    tokens' keys and values (default the whole block, ``block_tokens``; under a window only the
    keys the receiver's queries reach, :func:`costmodel.ring.window.hop_tokens`); the merges run
    over the rank's ``block_tokens`` queries.

    ``additive_only``: a lower bound that is additive over a call's samples. A step is
    ``max(c, h) + f min(c, h) + o = (1 - f) max(c, h) + f (c + h) + o`` with ``c`` the call's
    attention (a sum over its samples), ``h = alpha + sum of the samples' block bytes / bandwidth``
    and ``f`` the exposed fraction. For any ``lam`` in [0, 1], ``max(c, h) >= lam c + (1 - lam) h``,
    so dropping ``alpha`` and ``o`` (one per call, not per sample) a step is at least
    ``(lam (1 - f) + f) c + ((1 - lam)(1 - f) + f) bytes / bandwidth``, each term a sum over the
    samples: every sample's share bounds its part of any call from below, provided one ``lam``
    (``compute_weight``) is used for all of them (1: compute-bound steps; 0: hop-bound ones).
    The last block's step has no hop; the merges and the gradients' hop home (bytes only) are
    additive as they stand. Under a window a call runs ``n`` steps, at least each of its samples'
    own ``n_s`` and at most ``r``: its ``n - 1`` hops and merges are charged at the sample's
    ``n_s``, and its attention ``C`` (over ``n`` steps, ``C ((n - 1) w_c + 1) / n``, which falls
    as ``n`` grows) at ``n = r``, so the sample's share stays below its part of any call."""
    r = ring_degree
    n = np.asarray(float(r) if steps_run is None else steps_run, dtype=np.float64)
    fwd_charged, bwd_charged = n * steps.forward_charged, n * steps.backward_charged
    if r == 1:
        zero = np.zeros_like(fwd_charged)
        return fwd_charged, bwd_charged, zero, zero
    link = links.link(crosses_nodes=crosses_nodes)
    block_bytes = (block_tokens if hop_tokens is None else hop_tokens) * kv_bytes_per_token
    travelled = n > 1  # a step brought a remote block: its gradients go home
    merges = (n - 1) * block_tokens * query_channels * ring.merge_bytes_per_channel / hbm_bytes_per_s
    if additive_only:  # no latency and no per-step cost (per call); see the docstring
        if not 0.0 <= compute_weight <= 1.0:
            raise ValueError(f"compute_weight must be in [0, 1], got {compute_weight}")
        f = ring.exposed_fraction
        w_compute, w_hop = compute_weight * (1 - f) + f, (1 - compute_weight) * (1 - f) + f
        share = w_compute + (1 - w_compute) / r  # of a call's attention, at its most steps (r)
        hop_bytes_s = block_bytes / link.bytes_per_s
        forward = share * n * steps.forward + (n - 1) * w_hop * hop_bytes_s + merges
        backward = share * n * steps.backward + (n - 1) * w_hop * 2 * hop_bytes_s + travelled * hop_bytes_s
    else:
        hop, hop2 = link.alpha_s + block_bytes / link.bytes_per_s, link.alpha_s + 2 * block_bytes / link.bytes_per_s
        last = ring.step_overhead_s
        forward = (n - 1) * step_s(steps.forward, hop, ring) + steps.forward + last + merges
        backward = (n - 1) * step_s(steps.backward, hop2, ring) + steps.backward + last + travelled * hop
    return forward, backward, forward - fwd_charged, backward - bwd_charged


def ring_kv_buffer_bytes(tokens: Sequence[int] | Sequence[float], model: ModelSpec, *, ulysses_degree: int,
                         ring_degree: int, element_bytes: float = KV_ELEMENT_BYTES) -> float:
    """Extra bytes one rank holds for the ring at its peak: two key/value blocks in forward (the
    block in hand and the one arriving), four in backward (both blocks' keys and values and their
    gradients); 0 for a pure Ulysses group (``ring_degree == 1``)."""
    if ring_degree <= 1:
        return 0.0
    block = math.fsum(tokens) / ring_degree * kv_bytes_per_token(model, ulysses_degree=ulysses_degree,
                                                                  element_bytes=element_bytes)
    return 4.0 * block


def calls_exposed_s(tokens: Sequence[float], recompute_layers: Sequence[int], *, num_layers: int,
                    exposed: Callable[[list[float]], tuple[float, float]]) -> float:
    """What a ring adds to one micro-batch over all its layer calls, given ``exposed(tokens of one
    call) -> (forward, backward)`` seconds of one layer's ring on those samples.

    A sample of policy ``k`` recomputes its first ``k`` layers. At layer ``l`` the samples with
    ``k > l`` (checkpointed there) and the others run as separate calls when both are present, each
    its own ring over its own samples (``CostModel.layer_calls``); each call pays its forward and
    backward ring, the checkpointed call also its forward again in the recompute.

    Raises:
        ValueError: when the samples and the policies differ in number.
    """
    if len(tokens) != len(recompute_layers):
        raise ValueError(f"{len(tokens)} samples but {len(recompute_layers)} policies")
    if not tokens:
        return 0.0
    cuts = sorted({0, num_layers, *(min(max(int(k), 0), num_layers) for k in recompute_layers)})
    total = 0.0
    for lo, hi in itertools.pairwise(cuts):
        kept = [float(s) for s, k in zip(tokens, recompute_layers, strict=True) if k > lo]  # recomputed here
        plain = [float(s) for s, k in zip(tokens, recompute_layers, strict=True) if k <= lo]
        per_layer = 0.0
        if kept:
            f, b = exposed(kept)
            per_layer += 2 * f + b
        if plain:
            f, b = exposed(plain)
            per_layer += f + b
        total += (hi - lo) * per_layer
    return total


def reduce_columns(columns: np.ndarray, *, max_columns: int = 0) -> np.ndarray:
    """One call's columns from its samples' (rows): the sum of each, but the last ``max_columns``
    (a sliding-window layer's remote steps: the call runs the most any of its samples needs)."""
    cols = np.asarray(columns, dtype=np.float64)
    if not max_columns:
        return np.asarray(cols.sum(axis=0), dtype=np.float64)
    cut = cols.shape[-1] - max_columns
    return np.concatenate([cols[:, :cut].sum(axis=0), cols[:, cut:].max(axis=0)])


def microbatches_exposed_s(columns: np.ndarray, recompute_layers: np.ndarray, starts: np.ndarray, *,
                           num_layers: int, exposed: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                           max_columns: int = 0) -> np.ndarray:
    """:func:`calls_exposed_s` of many micro-batches at once, the same sums in the same order.

    Args:
        columns: Per sample (rows; the micro-batches one after another) the quantities a ring's
            exposed time depends on, additive over a call's samples (its tokens, and its pairs
            weighted by the kernels' time multipliers: :func:`ring_attention_time_s`).
        recompute_layers: Policy ``k`` of every sample.
        starts: Offset of each micro-batch's first sample (increasing, ``starts[0] == 0``; every
            micro-batch non-empty).
        num_layers: ``L``.
        exposed: ``exposed(column sums of each call)`` -> ``(forward, backward)`` seconds of one
            layer's ring for those calls (arrays, one entry per call).
        max_columns: The last columns a call reduces by their maximum, not their sum
            (:func:`reduce_columns`).

    Returns:
        Seconds each micro-batch's rings add (one entry per micro-batch).
    """
    cols = np.asarray(columns, dtype=np.float64)
    k = np.clip(np.asarray(recompute_layers, dtype=np.int64), 0, num_layers)
    starts = np.asarray(starts, dtype=np.int64)
    if len(starts) == 0:
        return np.zeros(0)
    sums = np.add.reduceat(cols, starts, axis=0)
    if max_columns:
        cut = cols.shape[-1] - max_columns
        sums[:, cut:] = np.maximum.reduceat(cols[:, cut:], starts, axis=0)
    k_hi, k_lo = np.maximum.reduceat(k, starts), np.minimum.reduceat(k, starts)
    # One policy per micro-batch (the common case): one call per layer, the first k recomputed.
    f, b = exposed(sums)
    kf = k_hi.astype(np.float64)
    out = kf * (2 * f + b) + (num_layers - kf) * (f + b)
    mixed = np.flatnonzero(k_hi != k_lo).tolist()
    if mixed:  # calls_exposed_s's segments, their calls' sums gathered into one exposed() call
        ends = [*starts[1:].tolist(), len(cols)]
        start_list = starts.tolist()
        calls: list[tuple[int, int, int, int]] = []  # (micro-batch, layers, kept call or -1, plain call or -1)
        call_sums: list[np.ndarray] = []
        for m in mixed:
            a, e = start_list[m], ends[m]
            seg_c, seg_k = cols[a:e], k[a:e]
            cuts = sorted({0, num_layers, *seg_k.tolist()})
            for lo, hi in itertools.pairwise(cuts):
                ids = []
                for part in (seg_c[seg_k > lo], seg_c[seg_k <= lo]):
                    if len(part):
                        ids.append(len(call_sums))
                        call_sums.append(reduce_columns(part, max_columns=max_columns))
                    else:
                        ids.append(-1)
                calls.append((m, hi - lo, ids[0], ids[1]))
        cf, cb = exposed(np.array(call_sums))
        cf_list, cb_list = cf.tolist(), cb.tolist()
        totals = dict.fromkeys(mixed, 0.0)
        for m, layers, kept, plain in calls:
            per_layer = 0.0
            if kept >= 0:
                per_layer += 2 * cf_list[kept] + cb_list[kept]
            if plain >= 0:
                per_layer += cf_list[plain] + cb_list[plain]
            totals[m] += layers * per_layer
        out[mixed] = [totals[m] for m in mixed]
    return np.asarray(out, dtype=np.float64)
