"""Cost-model revisions, per-epoch recalibration state and frozen steps, in the plan store.

* A revision ``id@rev`` (``rev >= 1``; ``id@0`` is the uploaded or embedded file) is written
  once and never changed, with the factors it applied to ``id@0`` and its fit quality.
* Freezing: the first fetch of a step's rank view raises the epoch's ``frozen_through`` to that
  step and writes it to the store before the view is served (one small commit per newly fetched
  step, none for the fetches after it), so a step a rank has received stays frozen across a
  crash of the service (``kill -9``) and a restart. A re-plan checks it under the same lock and
  commits holding it (:meth:`RevisionStore.replace_unfrozen`), so a step any rank has fetched
  never changes. The write waits at most ``FREEZE_BUSY_S`` for a store locked by another
  process; past that (or on a read-only store) the step is frozen in this process (the writer
  lease makes it the store's only writer) and served, and a thread writes it every ``FLUSH_S``
  until it lands: a locked store still serves stored steps, and only a crash inside that
  window can let such a step be re-planned after a restart (the ranks' digest check then stops a
  rank holding the old plan). Steps at or below a fetched one are frozen too (ranks fetch in
  order). With an auth token set, only a fetch that carries it freezes (an anonymous read cannot
  block recalibration).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from api.store import PlanStore
from api.store_schema import ThreadConnections, connect, transaction
from costmodel.schema import CostModelFile
from planner.epoch import StepResult

logger = logging.getLogger(__name__)

FLUSH_S = 0.5
"""How often the freezes a fetch could not write (a locked or read-only store) are written."""

FREEZE_BUSY_S = 0.2
"""Longest wait of a fetch (on a worker thread) to write its freeze to a store locked by another
writer; the event loop's fast path does not wait (the route retries on a thread)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RecalibrationState:
    """One epoch's recalibration settings and progress."""

    follow: bool
    """Re-plan the steps not fetched yet with each new revision."""
    every_steps: int
    """Recalibrate after this many newly measured steps (0 = never)."""
    frozen_through: int
    """Highest step any rank has fetched (-1: none)."""
    steps_at_fit: int
    """Measured steps at the last recalibration."""
    current_rev: int
    """Revision the epoch's newest plans use (0: the original file)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Revision:
    """A stored cost-model revision."""

    cost_model_id: str
    """Base id."""
    rev: int
    """Revision number (>= 1)."""
    file: CostModelFile
    """Its coefficients (``id`` is ``base@rev``)."""
    scales: dict[str, float]
    """Factors per term applied to revision 0."""
    fit: dict[str, Any]
    """Fit quality (``costmodel.recalibrate.FitQuality`` fields)."""
    source_epoch: str | None
    """Epoch whose measurements it was fitted on."""
    created_at: float
    """Unix time."""

    @property
    def ref(self) -> str:
        """``id@rev``."""
        return f"{self.cost_model_id}@{self.rev}"


def split_ref(ref: str) -> tuple[str, int]:
    """``(base id, rev)`` of ``id@rev`` (revision 0 for a plain id)."""
    base, _, rev = ref.partition("@")
    return base, int(rev) if rev.isdigit() else 0


def revision_ref(cost_model_id: str, rev: int) -> str:
    """``id@rev``; revision 0 is the base id itself."""
    return cost_model_id if rev == 0 else f"{cost_model_id}@{rev}"


class RevisionStore:
    """Queries of the revision and recalibration tables."""

    def __init__(self, store: PlanStore) -> None:
        self.store = store
        self._frozen: dict[str, int] = {}
        self._persisted: dict[str, int] = {}
        self._lock = threading.Lock()
        self._conns = ThreadConnections()
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="freeze-flush", daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------ state
    def state(self, epoch_id: str) -> RecalibrationState:
        """The epoch's state (defaults when nothing was recorded)."""
        row = self.store._conn().execute("SELECT * FROM epoch_recalibration WHERE epoch_id=?",
                                         (epoch_id,)).fetchone()
        if row is None:
            with self._lock:
                frozen = self._frozen.get(epoch_id, -1)
            return RecalibrationState(follow=False, every_steps=0, frozen_through=frozen, steps_at_fit=0,
                                      current_rev=0)
        with self._lock:  # fetches not flushed yet count
            frozen = max(int(row["frozen_through"]), self._frozen.get(epoch_id, -1))
        return RecalibrationState(follow=bool(row["follow"]), every_steps=row["every_steps"],
                                  frozen_through=frozen, steps_at_fit=row["steps_at_fit"],
                                  current_rev=row["current_rev"])

    def configure(self, epoch_id: str, *, follow: bool, every_steps: int) -> RecalibrationState:
        """Set the epoch's recalibration settings."""
        with transaction(self.store._conn()) as conn:
            conn.execute("INSERT INTO epoch_recalibration(epoch_id, follow, every_steps) VALUES (?, ?, ?) "
                         "ON CONFLICT(epoch_id) DO UPDATE SET follow=excluded.follow, "
                         "every_steps=excluded.every_steps", (epoch_id, int(follow), every_steps))
        return self.state(epoch_id)

    def record_fit(self, epoch_id: str, *, steps_at_fit: int, rev: int) -> None:
        """Note a recalibration of the epoch (its measured steps then, the revision it follows)."""
        with transaction(self.store._conn()) as conn:
            conn.execute("INSERT INTO epoch_recalibration(epoch_id, steps_at_fit, current_rev) VALUES (?, ?, ?) "
                         "ON CONFLICT(epoch_id) DO UPDATE SET steps_at_fit=excluded.steps_at_fit, "
                         "current_rev=excluded.current_rev", (epoch_id, steps_at_fit, rev))

    # --------------------------------------------------------------- freezing
    def _freeze_conn(self, *, fast: bool, busy_timeout_s: float | None = None) -> sqlite3.Connection:
        """A connection of this thread for freezing: ``synchronous=NORMAL`` (a commit is in the
        WAL, safe from a crash of the service, and synced by the next FULL commit of any
        connection), no WAL checkpoint (that syncs the file: left to the store's writers), no busy
        wait on the event loop's fast path, ``busy_timeout_s`` (default: the store's) elsewhere."""
        wait_s = 0.0 if fast else (self.store.busy_timeout_s if busy_timeout_s is None else busy_timeout_s)

        def open_conn() -> sqlite3.Connection:
            conn = connect(self.store.path, busy_timeout_s=wait_s)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints run on the store's writers
            return conn

        return self._conns.get(f"freeze-{wait_s:g}", open_conn)

    def _write_frozen(self, conn: sqlite3.Connection, frozen: dict[str, int]) -> None:
        with transaction(conn):
            for epoch_id, step in frozen.items():
                conn.execute("INSERT INTO epoch_recalibration(epoch_id, frozen_through) VALUES (?, ?) "
                             "ON CONFLICT(epoch_id) DO UPDATE SET frozen_through="
                             "max(frozen_through, excluded.frozen_through)", (epoch_id, step))

    def _note_persisted(self, frozen: dict[str, int]) -> None:
        for epoch_id, step in frozen.items():
            self._persisted[epoch_id] = max(self._persisted.get(epoch_id, -1), step)

    def close(self) -> None:
        """Persist what was frozen and close the connections."""
        self._closed.set()
        self._flusher.join(timeout=5.0)
        self.flush()
        self._conns.close()

    def _flush_loop(self) -> None:
        while not self._closed.wait(FLUSH_S):
            try:
                self.flush()
            except sqlite3.Error as exc:  # a locked or read-only store: the next round tries again
                logger.debug("frozen steps not persisted yet: %s", exc)

    def flush(self) -> None:
        """Write every epoch's ``frozen_through`` that moved since the last write."""
        with self._lock:
            moved = {e: f for e, f in self._frozen.items() if f > self._persisted.get(e, -1)}
        if moved:  # written without the lock: fetches and re-plans go on meanwhile
            self._write_frozen(self._freeze_conn(fast=False), moved)
            with self._lock:
                self._note_persisted(moved)

    def _stored_frozen(self, epoch_id: str, *, fast: bool) -> int:
        row = self._freeze_conn(fast=fast).execute(
            "SELECT frozen_through FROM epoch_recalibration WHERE epoch_id=?", (epoch_id,)).fetchone()
        return -1 if row is None else int(row["frozen_through"])

    def frozen_through(self, epoch_id: str) -> int:
        """The highest step fetched (stored or in this process only), -1 when none."""
        stored = self._stored_frozen(epoch_id, fast=False)
        with self._lock:
            return max(stored, self._frozen.get(epoch_id, -1))

    def fetch_rank_view(self, epoch_id: str, step: int, rank: int, *, fast: bool = False,
                        freeze: bool = True) -> str | None:
        """``PlanStore.get_rank_view``, freezing a stored step (``freeze``) the first time it is
        served: in memory, before the view is read again and returned, so a re-plan committed
        earlier is what the rank gets and one not yet committed sees the step frozen.

        Raises:
            ValueError: when the step is stored but the rank is outside its world.
            sqlite3.Error: a store locked by a writer (``fast``: at once, and also when a re-plan
                holds the freezing lock; the route then retries on a worker thread).
        """
        view = self.store.get_rank_view(epoch_id, step, rank, fast=fast)
        if view is None or not freeze:
            return view
        with self._lock:
            known = self._frozen.get(epoch_id)
        if known is not None and step <= known:
            return view
        stored = self._stored_frozen(epoch_id, fast=fast) if known is None else -1
        if not self._lock.acquire(blocking=not fast):  # a re-plan is committing: not on the event loop
            raise sqlite3.OperationalError("a re-plan holds the freezing lock; retry on a thread")
        try:
            before = max(self._frozen.get(epoch_id, -1), stored)
            if step > before:
                self._freeze_durably(epoch_id, step, fast=fast)
        finally:
            self._lock.release()
        if step <= before:
            return view
        # First fetch of this step: read again, now that no re-plan of it can commit.
        return self.store.get_rank_view(epoch_id, step, rank, fast=fast)

    def _freeze_durably(self, epoch_id: str, step: int, *, fast: bool) -> None:
        """Freeze through ``step`` and write it (module docstring), holding ``_lock``.

        Raises:
            sqlite3.Error: on the fast path, when the store is locked (the route retries on a
                thread, which waits up to ``FREEZE_BUSY_S`` and then freezes in memory).
        """
        try:
            self._write_frozen(self._freeze_conn(fast=fast, busy_timeout_s=FREEZE_BUSY_S), {epoch_id: step})
            self._note_persisted({epoch_id: step})
        except sqlite3.Error as exc:
            if fast:
                raise
            logger.warning("epoch %s: step %d frozen in memory only for now (%s); written when the "
                           "store takes it", epoch_id, step, exc)
        self._frozen[epoch_id] = step

    def replace_unfrozen(self, epoch_id: str, results: Sequence[StepResult], *, rev: int
                         ) -> tuple[list[int], list[int]]:
        """Store re-planned steps that no rank has fetched, in one transaction.

        Returns:
            ``(steps replaced, steps left because they were frozen or not stored)``.
        """
        replaced: list[int] = []
        left: list[int] = []
        now = time.time()
        # Held through the commit: no first fetch can freeze a step between the check and the write.
        with self._lock, transaction(self.store._conn()) as conn:
            row = conn.execute("SELECT frozen_through FROM epoch_recalibration WHERE epoch_id=?",
                               (epoch_id,)).fetchone()
            frozen = max(-1 if row is None else int(row["frozen_through"]), self._frozen.get(epoch_id, -1))
            for r in results:
                assert r.step is not None
                old = conn.execute("SELECT gap, predicted_step_time_s, speedup_vs_bucket, speedup_vs_strongest "
                                   "FROM plans WHERE epoch_id=? AND step=?", (epoch_id, r.step)).fetchone()
                if r.step <= frozen or old is None:
                    left.append(r.step)
                    continue
                conn.execute("UPDATE plans SET digest=?, plan=?, gap=?, predicted_step_time_s=?, "
                             "speedup_vs_bucket=?, solve_time_s=?, speedup_vs_strongest=? WHERE epoch_id=? AND step=?",
                             (r.digest, r.plan_json, r.gap, r.predicted_step_time_s, r.speedup_vs_bucket,
                              r.solve_time_s, r.speedup_vs_strongest, epoch_id, r.step))
                conn.execute("DELETE FROM plan_groups WHERE epoch_id=? AND step=?", (epoch_id, r.step))
                conn.executemany("INSERT INTO plan_groups(epoch_id, step, first_rank, last_rank, view) "
                                 "VALUES (?, ?, ?, ?, ?)",
                                 [(epoch_id, r.step, first, last, view) for first, last, view in r.group_views])
                old_speedup = old["speedup_vs_bucket"]
                new_speedup = r.speedup_vs_bucket
                old_strong, new_strong = old["speedup_vs_strongest"], r.speedup_vs_strongest
                conn.execute(
                    "UPDATE epochs SET sum_gap = sum_gap + ?, sum_step_time_s = sum_step_time_s + ?, "
                    "sum_speedup = sum_speedup + ?, num_speedup = num_speedup + ?, "
                    "sum_speedup_strongest = sum_speedup_strongest + ?, "
                    "num_speedup_strongest = num_speedup_strongest + ? WHERE id=?",
                    (r.gap - old["gap"], r.predicted_step_time_s - old["predicted_step_time_s"],
                     (new_speedup or 0.0) - (old_speedup or 0.0),
                     int(new_speedup is not None) - int(old_speedup is not None),
                     (new_strong or 0.0) - (old_strong or 0.0),
                     int(new_strong is not None) - int(old_strong is not None), epoch_id))
                conn.execute("INSERT OR REPLACE INTO step_revisions(epoch_id, step, rev, replanned_at) "
                             "VALUES (?, ?, ?, ?)", (epoch_id, r.step, rev, now))
                replaced.append(r.step)
        return replaced, left

    def step_revisions(self, epoch_id: str) -> dict[int, int]:
        """Revision of every re-planned step (steps absent: revision 0)."""
        rows = self.store._conn().execute("SELECT step, rev FROM step_revisions WHERE epoch_id=?", (epoch_id,))
        return {r["step"]: r["rev"] for r in rows}

    # -------------------------------------------------------------- revisions
    def add_revision(self, base: CostModelFile, *, make_file: Any, scales: dict[str, float],
                     fit: dict[str, Any], source_epoch: str | None) -> Revision:
        """Write the next revision of ``base`` (``make_file(rev) -> CostModelFile``) and return it."""
        with transaction(self.store._conn()) as conn:
            row = conn.execute("SELECT MAX(rev) AS r FROM cost_model_revisions WHERE cost_model_id=?",
                               (base.id,)).fetchone()
            rev = (row["r"] or 0) + 1
            file: CostModelFile = make_file(rev)
            created = time.time()
            conn.execute("INSERT INTO cost_model_revisions(cost_model_id, rev, body, digest, scales, fit, "
                         "source_epoch, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (base.id, rev, file.model_dump_json(), file.digest(), json.dumps(scales),
                          json.dumps(fit), source_epoch, created))
        return Revision(cost_model_id=base.id, rev=rev, file=file, scales=scales, fit=fit,
                        source_epoch=source_epoch, created_at=created)

    def revisions(self, cost_model_id: str) -> list[Revision]:
        """Every revision of a cost model, oldest first."""
        rows = self.store._conn().execute(
            "SELECT * FROM cost_model_revisions WHERE cost_model_id=? ORDER BY rev", (cost_model_id,))
        return [Revision(cost_model_id=r["cost_model_id"], rev=r["rev"],
                         file=CostModelFile.model_validate_json(r["body"]), scales=json.loads(r["scales"]),
                         fit=json.loads(r["fit"]), source_epoch=r["source_epoch"], created_at=r["created_at"])
                for r in rows]

    def latest(self, cost_model_id: str) -> Revision | None:
        """The newest revision, if any."""
        found = self.revisions(cost_model_id)
        return found[-1] if found else None
