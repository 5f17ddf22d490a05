"""Ring attention's cost: Ulysses x ring layouts, the time of a ring's steps, its memory, its fit.

* :mod:`costmodel.ring.layout`: where a group sits and how it splits its attention
  (:class:`GroupLayout`, :func:`nodes_spanned`);
* :mod:`costmodel.ring.timing`: the pure functions of a ring's time and buffers on one rank
  (:func:`ring_attention_time_s`, :func:`step_s`, :func:`p2p_time_s`, :func:`ring_kv_buffer_bytes`);
* :mod:`costmodel.ring.window`: the steps a sliding-window layer's ring runs
  (:func:`remote_steps`, :func:`call_remote_steps`, :func:`needed_positions`);
* :mod:`costmodel.ring.costs`: the ring part of :class:`costmodel.evaluate.CostModel`;
* :mod:`costmodel.ring.layer`: one layer's ring on a placed group (:func:`ring_layer_time_s`);
* :mod:`costmodel.ring.fit`: the ring's coefficients (:class:`costmodel.schema.RingCoefficients`)
  fitted to ``dcp profile-comm`` ring records and ``dcp profile`` ring compute records
  (:func:`fit_ring`); the p2p links by :func:`costmodel.fit_comm.fit_p2p`.

The fits are loaded on first use (they import the profile format and the presets, which import
the cost model that imports this package).
"""

from __future__ import annotations

from typing import Any

from costmodel.ring.layer import ring_layer_time_s
from costmodel.ring.layout import GroupLayout, nodes_spanned
from costmodel.ring.timing import (
    RingLayerTime,
    StepSeconds,
    default_p2p_links,
    kv_bytes_per_token,
    p2p_time_s,
    ring_attention_time_s,
    ring_kv_buffer_bytes,
    step_s,
)
from costmodel.ring.window import call_remote_steps, needed_positions, remote_steps
from costmodel.schema import P2PLinks, RingCoefficients

__all__ = ["GroupLayout", "P2PLinks", "RingCoefficients", "RingLayerTime", "StepSeconds", "call_remote_steps",
           "default_p2p_links", "fit_p2p", "fit_ring", "kv_bytes_per_token", "needed_positions", "nodes_spanned",
           "p2p_time_s", "remote_steps", "ring_attention_time_s", "ring_kv_buffer_bytes", "ring_layer_time_s",
           "step_s"]


def __getattr__(name: str) -> Any:
    if name == "fit_p2p":
        from costmodel.fit_comm import fit_p2p

        return fit_p2p
    if name == "fit_ring":
        from costmodel.ring.fit import fit_ring

        return fit_ring
    raise AttributeError(f"module 'costmodel.ring' has no attribute {name!r}")
