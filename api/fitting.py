"""Fitting an uploaded profile into a cost-model file (runs in a solver-pool worker; no torch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from costmodel.schema import CostModelFile


def fit_profile_texts(texts: Sequence[str], options: Mapping[str, Any]) -> CostModelFile:
    """Parse ``dcp-profile`` texts and fit them (``costmodel.fit.fit_profiles``).

    Raises:
        ValueError: naming the profile (``profiles_jsonl[i]``), line and reason, an invalid
            option, or a refused fit (``FitRefusedError`` names the terms).
    """
    from costmodel.fit import FitConfig, fit_profiles
    from costmodel.profiling.format import parse_profile_lines

    profiles = [parse_profile_lines(text.splitlines(), source=f"profiles_jsonl[{i}]")
                for i, text in enumerate(texts)]
    try:
        config = FitConfig(**options)
    except TypeError as exc:
        raise ValueError(f"invalid fit options: {exc}") from None
    return fit_profiles(profiles, config).file
