"""A bounded LRU of the rank views of recently fetched steps.

All ranks of a step fetch their part at about the same time; the stored plan is parsed once
and every rank's ``RankPlan`` JSON is rendered from it. Stored plans never change (a step is
written once), so a cached view stays valid. Bounded: plans are served from the store, not
held in memory.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any


def render_rank_views(plan_json: str, *, digest: str) -> list[bytes]:
    """The JSON of ``planner.plan.RankPlan`` for every rank of a stored (validated) plan.

    Equivalent to ``Plan.model_validate_json(plan_json).rank_view(r)`` with ``plan_digest``
    the stored digest, without re-validating the plan (tests check the equivalence).
    """
    data: dict[str, Any] = json.loads(plan_json)
    groups = data["groups"]
    common = {"schema_version": data["schema_version"], "step": data["step"],
              "num_ranks": data["num_ranks"], "group_sizes": [len(g["ranks"]) for g in groups],
              "loss_normalizer": data["loss_normalizer"], "plan_digest": digest,
              "cost_model_id": data["cost_model_id"]}
    views: list[bytes] = [b""] * data["num_ranks"]
    for group in groups:
        group_json = json.dumps(group, separators=(",", ":"))
        for rank in group["ranks"]:
            head = json.dumps({**common, "rank": rank}, separators=(",", ":"))
            views[rank] = f'{head[:-1]},"group":{group_json}}}'.encode()
    return views


class PlanCache:
    """LRU of ``(epoch, step) -> rank views``."""

    def __init__(self, *, max_steps: int) -> None:
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        self.max_steps = max_steps
        self._views: OrderedDict[tuple[str, int], list[bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, epoch_id: str, step: int) -> list[bytes] | None:
        """The cached views of a step, or None."""
        key = (epoch_id, step)
        with self._lock:
            views = self._views.get(key)
            if views is not None:
                self._views.move_to_end(key)
            return views

    def put(self, epoch_id: str, step: int, *, digest: str, plan_json: str) -> list[bytes]:
        """Render and cache the views of a step."""
        views = render_rank_views(plan_json, digest=digest)
        if self.max_steps:
            with self._lock:
                self._views[(epoch_id, step)] = views
                while len(self._views) > self.max_steps:
                    self._views.popitem(last=False)
        return views

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._views.clear()
