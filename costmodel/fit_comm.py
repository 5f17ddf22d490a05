"""Fitter of the collectives for ``costmodel.fit``: per op, placement, group size and node count;
and of ring attention's p2p links (:func:`fit_p2p`, ``alpha + bytes / bandwidth`` as
``costmodel.ring.timing.p2p_time_s`` times a hop).

The form is ``alpha*steps + wire/bandwidth`` (``costmodel.collectives.collective_time_s``), so a
fitted link reproduces the records it was fitted on. numpy only: the service fits without torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from costmodel.collectives import latency_steps, wire_bytes
from costmodel.fit_terms import FloatArray, SplitConfig, TermResult, fit_linear_term, mape, split_indices, timing
from costmodel.presets import load_hardware
from costmodel.profiling.format import CommRecord
from costmodel.ring.timing import default_p2p_links, p2p_time_s
from costmodel.schema import LinkFit, P2PLinks

_MIN_BANDWIDTH_BYTES_PER_S = 1e-30  # floor for 1/bandwidth; keeps bytes_per_s finite


def _fit_latency_over_wire(name: str, steps: float, wire_s: FloatArray, y: FloatArray, split: SplitConfig
                           ) -> tuple[float, TermResult]:
    """The per-operation latency ``alpha`` with the wire time known: ``steps * alpha + wire_s ~ y``,
    non-negative, in relative least squares on a training split; MAPE on the held-out one."""
    train, held = split_indices(len(y), fraction=split.holdout_fraction, min_train=2, seed=split.seed, term=name)
    yt, wt = y[train], wire_s[train]
    alpha = max(0.0, float(np.sum(steps * (yt - wt) / yt**2) / np.sum((steps / yt) ** 2)))
    pred = steps * alpha + wire_s[held]
    return alpha, TermResult(name, mape(y[held], pred), len(train), len(held), y[held], pred)


def _comm_design(op: str, d: int, records: Sequence[CommRecord], split: SplitConfig
                 ) -> tuple[FloatArray, FloatArray]:
    """``[latency_steps, wire_bytes]`` per record and its time."""
    steps = latency_steps(op, d)  # type: ignore[arg-type]
    a = np.array([[steps, float(wire_bytes(op, r.bytes_per_rank, d))] for r in records])  # type: ignore[arg-type]
    return a, np.array([timing(r, split.time_statistic) for r in records])


def fit_comm(records: Sequence[CommRecord], split: SplitConfig
             ) -> tuple[dict[str, list[LinkFit]], dict[str, TermResult]]:
    """Alpha-beta per op, placement, group size and node count; MAPE per op over all its groups.

    The design matrix is ``[latency_steps, wire_bytes]`` (``costmodel.evaluate``), so that the
    fitted link times a record exactly as ``collective_time_s`` does. Where a group has
    ``in_layer`` records (what a call adds inside the model's layers on the real group), the step
    pays those: the bandwidth comes from its ``isolated`` records (the wire is the same; back to
    back they measure it far more precisely) and the latency from the in-layer ones (what each
    call costs the layers around it); with no isolated records both come from the in-layer ones.
    The reported error is then the in-layer records'.
    """
    fits: dict[str, list[LinkFit]] = {"alltoall": [], "allreduce": []}
    results: dict[str, TermResult] = {}
    for op in ("alltoall", "allreduce"):
        recs = [r for r in records if r.op == op]
        keys = sorted({(r.group_size, r.num_nodes) for r in recs})
        measured, predicted, num_train = [], [], 0
        for d, nodes in keys:
            group = [r for r in recs if (r.group_size, r.num_nodes) == (d, nodes)]
            in_layer = [r for r in group if r.context == "in_layer"]
            isolated = [r for r in group if r.context == "isolated"]
            name = f"{op} (group size {d} over {nodes} node(s))"
            steps = latency_steps(op, d)  # type: ignore[arg-type]
            coef, res = fit_linear_term(name, *_comm_design(op, d, isolated or in_layer, split), split,
                                        hint="vary the message sizes")
            inv_bw = max(float(coef[1]), _MIN_BANDWIDTH_BYTES_PER_S)
            alpha = float(coef[0])
            if in_layer and isolated:
                a, y = _comm_design(op, d, in_layer, split)
                alpha, res = _fit_latency_over_wire(f"{name}, in the layers", steps, a[:, 1] * inv_bw, y, split)
            fits[op].append(LinkFit(placement="intra" if nodes == 1 else "inter", group_size=d,
                                    num_nodes=nodes, alpha_s=alpha, bytes_per_s=1.0 / inv_bw))
            measured.append(res.heldout_measured)
            predicted.append(res.heldout_predicted)
            num_train += res.num_points
        if keys:
            m, p = np.concatenate(measured), np.concatenate(predicted)
            results[op] = TermResult(op, mape(m, p), num_train, len(m), m, p)
    return fits, results


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


def p2p_term(records: Sequence[CommRecord], *, fallback_hardware: str, notes: list[str]
             ) -> tuple[P2PLinks, TermResult] | None:
    """The p2p links of a fit (:func:`fit_p2p`) and their error on the records they were fitted on
    (every record, as ``p2p_time_s`` times it); None without p2p records. An unmeasured inter-node
    link is the hardware preset's analytic one (``costmodel.ring.timing.default_p2p_links``), noted.

    Raises:
        ValueError: from :func:`fit_p2p` (no intra-node records of two sizes).
    """
    if not records:
        return None
    links, _ = fit_p2p(records)
    if links.inter is None:
        try:
            links = links.model_copy(update={"inter": default_p2p_links(load_hardware(fallback_hardware)).inter})
            notes.append(f"p2p inter: not measured, analytic default for {fallback_hardware}")
        except ValueError:
            notes.append(f"p2p inter: not measured and no hardware preset {fallback_hardware!r}: rings across "
                         "nodes use the cluster hardware's analytic link")
    measured = np.array([r.time_s for r in records], dtype=np.float64)
    predicted = np.array([float(p2p_time_s(links, r.bytes_per_rank, crosses_nodes=r.placement == "inter"))
                          for r in records], dtype=np.float64)
    notes.append(f"p2p links fitted to {len(records)} p2p records, checked on the same records")
    return links, TermResult("p2p", mape(measured, predicted), len(records), len(records), measured, predicted)
