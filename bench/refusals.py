"""A benchmark cell's refused steps, as its JSON records them and as a table shows them.

A step whose batch the planner refuses (a sample that fits nowhere on the cluster) has no plan to
measure; the cell keeps ``refused = {"steps": k, "of": n, "reason": message}``: ``k`` of its
``n`` steps refused, with the planner's message of the first. Its figures are over the other
steps; with none left it has no figures at all, and a table row says so in words.
"""

from __future__ import annotations

from typing import Any


def refused(num_refused: int, *, of: int, reason: str | None) -> dict[str, Any] | None:
    """The ``refused`` record of ``num_refused`` of ``of`` steps (None when none was)."""
    return {"steps": num_refused, "of": of, "reason": reason} if num_refused else None


def fully_refused(item: dict[str, Any]) -> bool:
    """Whether a cell summary (or any row carrying ``refused``) has no planned step at all."""
    r = item.get("refused")
    return r is not None and r["steps"] >= r["of"]


def refusal_note(item: dict[str, Any]) -> str:
    """``"refused: 3 of 3 steps (sample 'x' (219,600 tokens) fits nowhere)"``, the reason cut at
    its first ``": "`` (the sample and its size; the figures stay in the JSON); "" when none."""
    r = item.get("refused")
    if not r:
        return ""
    reason = (r.get("reason") or "").split(": ", 1)[0]
    return f"refused: {r['steps']} of {r['of']} steps" + (f" ({reason})" if reason else "")
