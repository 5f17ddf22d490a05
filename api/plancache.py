"""A small LRU of parsed plans and rendered rank views, so ranks fetching the same step do not
each re-parse the stored plan. Bounded: plans are served from the store, not held in memory."""

from __future__ import annotations

import threading
from collections import OrderedDict

from planner.plan import Plan, RankPlan


class PlanCache:
    """LRU of ``(epoch, step) -> Plan`` and ``(epoch, step, rank) -> RankPlan JSON bytes``."""

    def __init__(self, *, max_plans: int) -> None:
        if max_plans < 0:
            raise ValueError(f"max_plans must be >= 0, got {max_plans}")
        self.max_plans = max_plans
        self._plans: OrderedDict[tuple[str, int], tuple[str, Plan]] = OrderedDict()
        self._views: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, epoch_id: str, step: int, *, digest: str, plan_json: str) -> Plan:
        """The parsed plan (parsed once per digest while it stays cached)."""
        key = (epoch_id, step)
        with self._lock:
            hit = self._plans.get(key)
            if hit is not None and hit[0] == digest:
                self._plans.move_to_end(key)
                return hit[1]
        plan = Plan.model_validate_json(plan_json)
        if self.max_plans:
            with self._lock:
                self._plans[key] = (digest, plan)
                while len(self._plans) > self.max_plans:
                    self._plans.popitem(last=False)
        return plan

    def rank_view(self, epoch_id: str, step: int, rank: int, *, digest: str, plan_json: str) -> bytes:
        """JSON of ``RankPlan`` for one rank, carrying the stored digest of the whole plan.

        Raises:
            ValueError: when the rank is outside the plan's world.
        """
        key = (epoch_id, step, rank)
        with self._lock:
            hit = self._views.get(key)
            if hit is not None:
                self._views.move_to_end(key)
                return hit
        plan = self.plan(epoch_id, step, digest=digest, plan_json=plan_json)
        group = plan.group_of_rank(rank)
        view = RankPlan(step=plan.step, rank=rank, num_ranks=plan.num_ranks, group=group,
                        group_sizes=[g.size for g in plan.groups],
                        loss_normalizer=plan.loss_normalizer, plan_digest=digest,
                        cost_model_id=plan.cost_model_id)
        body = view.model_dump_json().encode()
        if self.max_plans:
            with self._lock:
                self._views[key] = body
                while len(self._views) > self.max_plans * 64:
                    self._views.popitem(last=False)
        return body

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._plans.clear()
            self._views.clear()
