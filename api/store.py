"""The durable plan store: one SQLite file holding cost models, epoch jobs and their plans.

The schema, its migrations and the transaction helper are in ``api.store_schema``; this
module holds the epoch and plan queries (uploaded cost models: ``api.cost_model_store``;
measurements and revisions: ``api.measurements_store``, ``api.revisions_store``). The file
is in WAL mode so that readers (the API) never wait for the writer (an epoch job). Every
write is one transaction; a plan row is inserted once (``INSERT OR IGNORE`` on
``(epoch_id, step)``) and the job's ``steps_done`` counter moves in the same transaction, so
a crash at any point leaves a consistent store: no plan lost once committed, none duplicated.

Each thread gets its own connection. The service calls the store from worker threads only
(``asyncio.to_thread``), never on the event loop, apart from the rank-view fast path, which
uses a connection with a very short busy timeout (``fast_reader=True``) and falls back to the
threaded route when the store is busy.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.store_schema import (
    STORE_SCHEMA_VERSION,
    ThreadConnections,
    connect,
    migrate,
    schema_version,
    transaction,
)
from costmodel.specs import Sample
from planner.epoch import StepResult, group_view_templates, rank_view_json

__all__ = ["STORE_SCHEMA_VERSION", "EpochExistsError", "EpochRecord", "PlanStore"]

JOB_STATES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_STATES = ("queued", "running")


class EpochExistsError(ValueError):
    """An epoch with this id is already stored."""


@dataclass(kw_only=True, frozen=True, slots=True)
class EpochRecord:
    """One epoch job as stored."""

    id: str
    """Epoch id."""
    state: str
    """queued, running, done, failed or cancelled."""
    spec: dict[str, Any]
    """What was asked: batch rule, seed, cluster, cost model id and digest, options, manifest."""
    steps_total: int
    """Steps of the epoch."""
    steps_done: int
    """Steps planned and stored."""
    created_at: float
    """Unix time of creation."""
    started_at: float | None
    """Unix time the (latest) run started."""
    finished_at: float | None
    """Unix time it ended (done, failed or cancelled)."""
    error: str | None
    """Why it failed."""
    transient: bool = False
    """True when it failed for a passing reason (killed worker, full disk, locked store)."""
    attempts: int = 0
    """Runs of the job that ended in a transient failure since its last success or resume."""


def _row_to_epoch(row: sqlite3.Row) -> EpochRecord:
    return EpochRecord(id=row["id"], state=row["state"], spec=json.loads(row["spec"]),
                       steps_total=row["steps_total"], steps_done=row["steps_done"],
                       created_at=row["created_at"], started_at=row["started_at"],
                       finished_at=row["finished_at"], error=row["error"],
                       transient=bool(row["transient"]), attempts=int(row["attempts"]))


class PlanStore:
    """A SQLite plan store (thread-safe: one connection per thread)."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 5.0,
                 fast_busy_timeout_s: float = 0.02) -> None:
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self.fast_busy_timeout_s = fast_busy_timeout_s
        self._conns = ThreadConnections()

    @classmethod
    def open(cls, path: str | Path, *, busy_timeout_s: float = 5.0) -> PlanStore:
        """Open (creating the file and parent folder when absent) and migrate the schema."""
        store = cls(path, busy_timeout_s=busy_timeout_s)
        store.path.parent.mkdir(parents=True, exist_ok=True)
        store.migrate()
        return store

    # ------------------------------------------------------------------ plumbing
    def _conn(self, *, fast: bool = False) -> sqlite3.Connection:
        timeout_s = self.fast_busy_timeout_s if fast else self.busy_timeout_s
        return self._conns.get("fast_conn" if fast else "conn",
                               lambda: connect(self.path, busy_timeout_s=timeout_s))

    def close(self) -> None:
        """Close every connection opened by this store."""
        self._conns.close()

    def schema_version(self) -> int:
        """The schema version of the file (0 for an empty file)."""
        return schema_version(self._conn())

    def migrate(self) -> None:
        """Create the schema or bring it up to ``STORE_SCHEMA_VERSION``.

        Raises:
            ValueError: when the file was written by a newer version.
        """
        migrate(self._conn(), self.path)

    # -------------------------------------------------------------------- epochs
    def create_epoch(self, epoch_id: str, *, spec: dict[str, Any],
                     steps: Sequence[Sequence[Sample]]) -> EpochRecord:
        """Store a new queued epoch with the membership of every step, in one transaction.

        Raises:
            EpochExistsError: when the id is taken.
        """
        now = time.time()
        with transaction(self._conn()) as conn:
            if conn.execute("SELECT 1 FROM epochs WHERE id=?", (epoch_id,)).fetchone():
                raise EpochExistsError(f"epoch {epoch_id!r} already exists")
            conn.execute("INSERT INTO epochs(id, state, spec, steps_total, created_at) "
                         "VALUES (?, 'queued', ?, ?, ?)",
                         (epoch_id, json.dumps(spec, sort_keys=True), len(steps), now))
            conn.executemany(
                "INSERT INTO epoch_batches(epoch_id, step, samples) VALUES (?, ?, ?)",
                ((epoch_id, i, json.dumps([s.model_dump(exclude_none=True) for s in batch]))
                 for i, batch in enumerate(steps)))
        record = self.get_epoch(epoch_id)
        assert record is not None
        return record

    def get_epoch(self, epoch_id: str) -> EpochRecord | None:
        """One epoch, or None."""
        row = self._conn().execute("SELECT * FROM epochs WHERE id=?", (epoch_id,)).fetchone()
        return None if row is None else _row_to_epoch(row)

    def list_epochs(self) -> list[EpochRecord]:
        """Every epoch, oldest first."""
        rows = self._conn().execute("SELECT * FROM epochs ORDER BY created_at, id").fetchall()
        return [_row_to_epoch(r) for r in rows]

    def set_state(self, epoch_id: str, state: str, *, error: str | None = None,
                  transient: bool = False) -> None:
        """Move a job to ``state`` (stamping start or finish time).

        Args:
            epoch_id: The job.
            state: One of ``JOB_STATES``.
            error: Why it failed or was interrupted (``failed``, or ``queued`` for a retry).
            transient: The failure may pass when retried (counted in ``attempts``); a job that
                ends ``done`` or is cancelled has its attempts reset.
        """
        if state not in JOB_STATES:
            raise ValueError(f"unknown job state {state!r}; known: {JOB_STATES}")
        now = time.time()
        conn = self._conn()
        if state == "running":
            conn.execute("UPDATE epochs SET state=?, started_at=?, finished_at=NULL, error=NULL, "
                         "transient=0 WHERE id=?", (state, now, epoch_id))
        elif state == "queued" and error is None:
            conn.execute("UPDATE epochs SET state=? WHERE id=?", (state, epoch_id))
        elif state in ("queued", "failed"):
            conn.execute("UPDATE epochs SET state=?, finished_at=?, error=?, transient=?, "
                         "attempts=attempts+? WHERE id=?",
                         (state, now, error, int(transient), int(transient), epoch_id))
        else:
            conn.execute("UPDATE epochs SET state=?, finished_at=?, error=?, transient=0, attempts=0 "
                         "WHERE id=?", (state, now, error, epoch_id))

    def reset_attempts(self, epoch_id: str) -> None:
        """Forget a job's transient failures (an operator resumed it)."""
        self._conn().execute("UPDATE epochs SET attempts=0, transient=0 WHERE id=?", (epoch_id,))

    def pending_steps(self, epoch_id: str) -> list[int]:
        """Steps of the epoch without a stored plan, ascending."""
        rows = self._conn().execute(
            "SELECT b.step FROM epoch_batches b LEFT JOIN plans p "
            "ON p.epoch_id=b.epoch_id AND p.step=b.step "
            "WHERE b.epoch_id=? AND p.step IS NULL ORDER BY b.step", (epoch_id,)).fetchall()
        return [r["step"] for r in rows]

    def batch_json(self, epoch_id: str, step: int) -> str:
        """The samples of one step as stored (a JSON list; membership fixed at creation).

        Raises:
            KeyError: for an unknown epoch or step.
        """
        row = self._conn().execute("SELECT samples FROM epoch_batches WHERE epoch_id=? AND step=?",
                                   (epoch_id, step)).fetchone()
        if row is None:
            raise KeyError(f"epoch {epoch_id!r} has no step {step}")
        return str(row["samples"])

    def batch(self, epoch_id: str, step: int) -> list[Sample]:
        """The samples of one step.

        Raises:
            KeyError: for an unknown epoch or step.
        """
        return [Sample.model_validate(s) for s in json.loads(self.batch_json(epoch_id, step))]

    def write_steps(self, epoch_id: str, results: Iterable[StepResult]) -> int:
        """Insert planned steps and advance ``steps_done``, in one transaction.

        Returns:
            Steps newly stored (a step already stored is left as it is).
        """
        with transaction(self._conn()) as conn:
            new = 0
            sum_gap = sum_step_time_s = sum_speedup = sum_strongest = 0.0
            num_speedup = num_strongest = 0
            for r in results:
                if r.step is None:
                    raise ValueError("an epoch step result needs a step index")
                cur = conn.execute(
                    "INSERT OR IGNORE INTO plans(epoch_id, step, digest, plan, gap, "
                    "predicted_step_time_s, speedup_vs_bucket, solve_time_s, speedup_vs_strongest) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (epoch_id, r.step, r.digest, r.plan_json, r.gap, r.predicted_step_time_s,
                     r.speedup_vs_bucket, r.solve_time_s, r.speedup_vs_strongest))
                if cur.rowcount:
                    new += 1
                    sum_gap += r.gap
                    sum_step_time_s += r.predicted_step_time_s
                    if r.speedup_vs_bucket is not None:
                        sum_speedup += r.speedup_vs_bucket
                        num_speedup += 1
                    if r.speedup_vs_strongest is not None:
                        sum_strongest += r.speedup_vs_strongest
                        num_strongest += 1
                    views = r.group_views or tuple(group_view_templates(r.plan_json, digest=r.digest))
                    conn.executemany(
                        "INSERT INTO plan_groups(epoch_id, step, first_rank, last_rank, view) "
                        "VALUES (?, ?, ?, ?, ?)",
                        [(epoch_id, r.step, first, last, view) for first, last, view in views])
            conn.execute("UPDATE epochs SET steps_done = steps_done + ?, sum_gap = sum_gap + ?, "
                         "sum_step_time_s = sum_step_time_s + ?, sum_speedup = sum_speedup + ?, "
                         "num_speedup = num_speedup + ?, sum_speedup_strongest = sum_speedup_strongest + ?, "
                         "num_speedup_strongest = num_speedup_strongest + ? WHERE id=?",
                         (new, sum_gap, sum_step_time_s, sum_speedup, num_speedup, sum_strongest, num_strongest,
                          epoch_id))
        return new

    def get_plan(self, epoch_id: str, step: int) -> tuple[str, str] | None:
        """``(digest, plan JSON)`` of a stored step, or None."""
        row = self._conn().execute("SELECT digest, plan FROM plans WHERE epoch_id=? AND step=?",
                                   (epoch_id, step)).fetchone()
        return None if row is None else (row["digest"], row["plan"])

    def get_rank_view(self, epoch_id: str, step: int, rank: int, *, fast: bool = False) -> str | None:
        """The ``RankPlan`` JSON of ``rank`` at a stored step, or None when the step is not stored.

        Raises:
            ValueError: when the step is stored but the rank is outside its world.
        """
        conn = self._conn(fast=fast)
        row = conn.execute(
            "SELECT last_rank, view FROM plan_groups WHERE epoch_id=? AND step=? AND first_rank<=? "
            "ORDER BY first_rank DESC LIMIT 1", (epoch_id, step, rank)).fetchone()
        if row is not None and rank <= row["last_rank"]:
            return rank_view_json(row["view"], rank)
        if fast:
            return None  # rendering an old row or naming the error is the route's work
        found = self.get_plan(epoch_id, step)
        if found is None:
            return None
        for first, last, view in group_view_templates(found[1], digest=found[0]):
            if first <= rank <= last:
                return rank_view_json(view, rank)
        raise ValueError(f"rank {rank} is not in the world of step {step} of epoch {epoch_id!r}")

    def get_plans(self, epoch_id: str, *, start: int, stop: int) -> list[tuple[int, str, str]]:
        """``(step, digest, plan JSON)`` of the stored steps in ``[start, stop)``, ascending."""
        rows = self._conn().execute(
            "SELECT step, digest, plan FROM plans WHERE epoch_id=? AND step>=? AND step<? ORDER BY step",
            (epoch_id, start, stop)).fetchall()
        return [(r["step"], r["digest"], r["plan"]) for r in rows]

    def step_figures(self, epoch_id: str, steps: Sequence[int]) -> list[dict[str, Any]]:
        """Of the stored ``steps``: the plan fields a report charts (step, predicted_step_time_s,
        lower_bound, solver.status, baselines_s, and the step's tokens as ``num_tokens``) read by
        SQLite's JSON functions, not parsed whole; ``solver.wall_time_s`` is the planner's wall
        time the store kept beside the plan (None for steps stored before schema version 7)."""
        out: list[dict[str, Any]] = []
        for i in range(0, len(steps), 500):
            chunk = list(steps[i:i + 500])
            rows = self._conn().execute(  # one JSON parse per plan for the four paths
                "SELECT step, predicted_step_time_s AS t, json_extract(plan, '$.lower_bound', "
                "'$.solver.status', '$.baselines_s') AS fields, solve_time_s, "
                "(SELECT sum(json_extract(s.value, '$.sample.tokens')) FROM json_each(plan, '$.groups') g, "
                "json_each(g.value, '$.micro_batches') m, json_each(m.value, '$.samples') s) AS tokens "
                f"FROM plans WHERE epoch_id=? AND step IN ({','.join('?' * len(chunk))})", (epoch_id, *chunk))
            for r in rows:
                bound, status, baselines = json.loads(r["fields"])
                out.append({"step": r["step"], "predicted_step_time_s": r["t"], "lower_bound": bound,
                            "solver": {"status": status, "wall_time_s": r["solve_time_s"]},
                            "baselines_s": baselines or {},
                            "num_tokens": int(r["tokens"] or 0)})
        return out

    def digests(self, epoch_id: str) -> dict[int, str]:
        """Digest of every stored step."""
        rows = self._conn().execute("SELECT step, digest FROM plans WHERE epoch_id=?", (epoch_id,))
        return {r["step"]: r["digest"] for r in rows}

    def summary(self, epoch_id: str) -> dict[str, float | None]:
        """Mean gap, mean predicted speedup over the strongest baseline (the headline) and over
        bucket-sp4 (the paper's), each over the steps that baseline planned (``steps_vs_*``: how
        many), and mean predicted step time (None before the first step; from running sums, no
        scan of the plans)."""
        row = self._conn().execute(
            "SELECT steps_done, sum_gap, sum_step_time_s, sum_speedup, num_speedup, sum_speedup_strongest, "
            "num_speedup_strongest FROM epochs WHERE id=?", (epoch_id,)).fetchone()
        if row is None or row["steps_done"] == 0:
            return {"mean_gap": None, "mean_speedup_vs_strongest": None, "mean_speedup_vs_bucket": None,
                    "mean_predicted_step_time_s": None, "steps_vs_strongest": 0, "steps_vs_bucket": 0}
        done = row["steps_done"]
        return {"mean_gap": row["sum_gap"] / done,
                "mean_speedup_vs_strongest": (row["sum_speedup_strongest"] / row["num_speedup_strongest"]
                                              if row["num_speedup_strongest"] else None),
                "mean_speedup_vs_bucket": (row["sum_speedup"] / row["num_speedup"]
                                           if row["num_speedup"] else None),
                "mean_predicted_step_time_s": row["sum_step_time_s"] / done,
                # the speedup means are over the steps where the baseline could plan: how many
                "steps_vs_strongest": int(row["num_speedup_strongest"] or 0),
                "steps_vs_bucket": int(row["num_speedup"] or 0)}

    def num_plans(self) -> int:
        """Plans stored over all epochs."""
        return int(self._conn().execute("SELECT COUNT(*) AS n FROM plans").fetchone()["n"])


class EpochSink:
    """The store seen as the sink of one epoch's results (``planner.epoch.StepSink``)."""

    def __init__(self, store: PlanStore, epoch_id: str) -> None:
        self.store = store
        self.epoch_id = epoch_id

    def write_steps(self, results: Sequence[StepResult]) -> int:
        """Store the results in one transaction."""
        return self.store.write_steps(self.epoch_id, results)
