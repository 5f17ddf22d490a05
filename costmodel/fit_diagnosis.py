"""Why a term's held-out error is high: noise, or the model's form.

A fit that misses by measurement noise has residuals of both signs in every group of like
records; one that misses by its form (a missing or wrong term) misses the same way on records of
the same kind: one sign for each group size, or for checkpointed against plain records. The
refusal of ``dcp fit`` says which, because the fixes differ (more repeats and a quieter machine,
or another profile or model), and names the groups whose residuals agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.fit_terms import TermResult

MIN_GROUP_POINTS = 2
"""Held-out points a group needs for its sign to count."""
BETWEEN_SHARE = 0.5
"""Share of the residuals' spread between groups above which the error is the model's form."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """The verdict on one term's held-out residuals."""

    kind: str
    """``model-form`` or ``noise`` (``unknown`` with too few held-out points)."""
    groups: tuple[tuple[str, float], ...]
    """Groups whose held-out residuals all have one sign, with their mean relative residual
    (``predicted / measured - 1``), largest first."""

    def describe(self) -> str:
        """One line for the refusal message."""
        if self.kind == "unknown":
            return "too few held-out points to tell noise from the model's form"
        if self.kind == "noise":
            return "looks like noise (residuals of both signs within each group size and policy)"
        listing = ", ".join(f"{label} {mean:+.0%}" for label, mean in self.groups[:4])
        return (f"a model-form error, not noise: the residuals have one sign by group ({listing}); "
                "more repeats will not fix it")


def diagnose(term: TermResult, labels: Sequence[str]) -> Diagnosis:
    """The diagnosis of ``term``'s held-out residuals, ``labels[i]`` the group of record ``i``
    (e.g. ``d=2 k>0``) in the list the term was fitted to."""
    if len(term.heldout_index) < 2 * MIN_GROUP_POINTS:
        return Diagnosis(kind="unknown", groups=())
    resid = term.heldout_predicted / term.heldout_measured - 1.0
    by_group: dict[str, list[float]] = {}
    for i, r in zip(term.heldout_index, resid, strict=True):
        by_group.setdefault(labels[i], []).append(float(r))
    one_sign = []
    for label, values in by_group.items():
        if len(values) >= MIN_GROUP_POINTS and (min(values) > 0 or max(values) < 0):
            one_sign.append((label, float(np.mean(values))))
    total = float(np.var(resid))
    means = np.array([np.mean(v) for v in by_group.values()])
    sizes = np.array([len(v) for v in by_group.values()])
    between = float(np.sum(sizes * (means - resid.mean()) ** 2) / len(resid))
    form = bool(one_sign) and total > 0 and between / total > BETWEEN_SHARE
    return Diagnosis(kind="model-form" if form else "noise",
                     groups=tuple(sorted(one_sign, key=lambda g: -abs(g[1]))))
