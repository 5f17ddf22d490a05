"""Checkpoint policies by name: ``none``, ``full`` or ``selective-k`` (``k`` of ``L`` layers recomputed).

A policy is the number ``k`` of the model's ``L`` layers whose activations are recomputed in
backward (``costmodel.evaluate``); these are its names in tables, the CLI and the API.
"""

from __future__ import annotations


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
