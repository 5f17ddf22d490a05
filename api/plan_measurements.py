"""Measured times of one-off plans (``POST /v1/plans`` answers, which the service does not store).

A post carries the plan itself; the service checks its digest and keeps the plan once per
digest with the cluster it ran on, and one row per rank. The newest ``MAX_PLANS_PER_MODEL``
plans of a cost model are kept (older ones are deleted, logged). ``observations`` turns them into
the micro-batch and peak records that ``api.recalibration.fit_revision_task`` fits.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

from api.measurements_store import RankMeasurement
from api.store import PlanStore
from api.store_schema import transaction
from costmodel.evaluate import nodes_spanned
from costmodel.specs import ClusterSpec
from planner.plan import GroupPlan, MicroBatch, Plan

logger = logging.getLogger(__name__)

MAX_PLANS_PER_MODEL = 2000
"""Measured one-off plans kept per cost model (the oldest are deleted past this)."""


def micro_batch_fields(mb: MicroBatch) -> dict[str, Any]:
    """A planned micro-batch's samples and checkpoint policies, JSON-ready (what the fits read)."""
    return {"samples": [ps.sample.model_dump(exclude_none=True) for ps in mb.samples],
            "policies": [ps.recompute_layers for ps in mb.samples]}


def peak_record(step: int, group: GroupPlan, peak_bytes: float) -> dict[str, Any]:
    """A measured group step's peak with its micro-batches (what the memory fit reads)."""
    return {"step": step, "first_rank": group.first_rank, "group_size": group.size,
            "ring_degree": group.ring_degree,
            "micro_batches": [micro_batch_fields(mb) for mb in group.micro_batches],
            "peak_bytes": float(peak_bytes)}


def base_id(cost_model_id: str) -> str:
    """``id`` of ``id@rev`` (a revision belongs to its base model)."""
    return cost_model_id.split("@", 1)[0]


class PlanMeasurementStore:
    """Queries of the one-off plan measurement tables."""

    def __init__(self, store: PlanStore, *, max_plans_per_model: int = MAX_PLANS_PER_MODEL) -> None:
        self.store = store
        self.max_plans_per_model = max_plans_per_model

    def add(self, plan: Plan, *, digest: str, cluster: ClusterSpec, rows: Sequence[RankMeasurement]
            ) -> tuple[int, int]:
        """Keep the plan (once) and the rank rows (a rank already reported is ignored).

        Returns:
            ``(rows stored, duplicates ignored)``.
        """
        now = time.time()
        model = base_id(plan.cost_model_id)
        with transaction(self.store._conn()) as conn:
            conn.execute("INSERT OR IGNORE INTO measured_plans(digest, cost_model_id, cluster, plan, received_at) "
                         "VALUES (?, ?, ?, ?, ?)", (digest, model, cluster.model_dump_json(),
                                                    plan.canonical_json(), now))
            stored = 0
            for r in rows:
                stored += conn.execute(
                    "INSERT OR IGNORE INTO plan_measurements(digest, rank, first_rank, group_size, times_s, "
                    "peak_bytes, received_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (digest, r.rank, r.first_rank, r.group_size, json.dumps(list(r.times_s)), r.peak_bytes,
                     now)).rowcount
            old = [row["digest"] for row in conn.execute(
                "SELECT digest FROM measured_plans WHERE cost_model_id=? ORDER BY received_at DESC, digest "
                "LIMIT -1 OFFSET ?", (model, self.max_plans_per_model)).fetchall()]
            for d in old:
                conn.execute("DELETE FROM plan_measurements WHERE digest=?", (d,))
                conn.execute("DELETE FROM measured_plans WHERE digest=?", (d,))
            if old:
                logger.info("cost model %s: %d measured one-off plans over the limit of %d deleted",
                            model, len(old), self.max_plans_per_model)
        return stored, len(rows) - stored

    def observations(self, cost_model_id: str, *, max_plans: int = 256
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """What the newest ``max_plans`` plans of a cost model measured, in one pass over them:
        their micro-batches (median over each group's reporting ranks), in
        ``api.recalibration.observations``' form plus ``num_nodes``, and their group peaks (the
        largest of each group's ranks; NULL or 0, no allocator peak, left out), in
        ``api.recalibration.peak_observations``' form. The plan's index in time order stands for
        the step."""
        conn = self.store._conn()
        plans = conn.execute("SELECT digest, cluster, plan FROM measured_plans WHERE cost_model_id=? "
                             "ORDER BY received_at DESC, digest LIMIT ?", (cost_model_id, max_plans)).fetchall()
        records: list[dict[str, Any]] = []
        peaks: list[dict[str, Any]] = []
        for index, row in enumerate(reversed(plans)):
            plan = Plan.model_validate_json(row["plan"])
            cluster = ClusterSpec.model_validate_json(row["cluster"])
            times: dict[int, list[list[float]]] = {}
            peak: dict[int, float] = {}
            for m in conn.execute("SELECT first_rank, times_s, peak_bytes FROM plan_measurements WHERE digest=?",
                                  (row["digest"],)):
                times.setdefault(m["first_rank"], []).append(json.loads(m["times_s"]))
                if m["peak_bytes"]:
                    peak[m["first_rank"]] = max(peak.get(m["first_rank"], 0.0), float(m["peak_bytes"]))
            for group in plan.groups:
                if group.first_rank not in times:
                    continue
                if group.first_rank in peak and group.micro_batches:
                    peaks.append(peak_record(index, group, peak[group.first_rank]))
                medians = [statistics.median(v) for v in zip(*times[group.first_rank], strict=True)]
                nodes = nodes_spanned(first_rank=group.first_rank, group_size=group.size,
                                      gpus_per_node=cluster.gpus_per_node)
                for mb, measured in zip(group.micro_batches, medians, strict=True):
                    records.append({"step": index, "first_rank": group.first_rank, "group_size": group.size,
                                    "ring_degree": group.ring_degree, "num_nodes": nodes, **micro_batch_fields(mb),
                                    "predicted_s": mb.predicted_time_s, "measured_s": measured})
        return records, peaks

    def cluster_json(self, cost_model_id: str) -> str | None:
        """The cluster of the newest measured plan of a cost model (for evaluating the model)."""
        row = self.store._conn().execute("SELECT cluster FROM measured_plans WHERE cost_model_id=? "
                                         "ORDER BY received_at DESC LIMIT 1", (cost_model_id,)).fetchone()
        return None if row is None else str(row["cluster"])
