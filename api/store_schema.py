"""The plan store's SQLite schema: migrations, connections and transactions.

The schema is created or migrated when the store is opened (``PlanStore.open``); each entry
of ``_MIGRATIONS`` moves the file one version up in one transaction. Connections run in WAL
mode (readers never wait for the writer) with a busy timeout, so a lock held by another
process makes a call wait at most that long and then fail with SQLite's own ``SQLITE_BUSY``
(``api.faults`` names it), never hang.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

STORE_SCHEMA_VERSION = 8

_MIGRATIONS: list[str] = [
    # 0 -> 1: initial schema.
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE cost_models (
        id TEXT PRIMARY KEY,
        provenance TEXT NOT NULL,
        digest TEXT NOT NULL,
        body TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE epochs (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        spec TEXT NOT NULL,
        steps_total INTEGER NOT NULL,
        steps_done INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        error TEXT
    );
    CREATE TABLE epoch_batches (
        epoch_id TEXT NOT NULL REFERENCES epochs(id),
        step INTEGER NOT NULL,
        samples TEXT NOT NULL,
        PRIMARY KEY (epoch_id, step)
    );
    CREATE TABLE plans (
        epoch_id TEXT NOT NULL REFERENCES epochs(id),
        step INTEGER NOT NULL,
        digest TEXT NOT NULL,
        plan TEXT NOT NULL,
        gap REAL NOT NULL,
        predicted_step_time_s REAL NOT NULL,
        speedup_vs_bucket REAL,
        PRIMARY KEY (epoch_id, step)
    );
    """,
    # 1 -> 2: rank views rendered at write time, one template per group (small rows, so a
    # rank's fetch reads neither the whole plan nor parses it). Older rows are rendered on read.
    """
    CREATE TABLE plan_groups (
        epoch_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        first_rank INTEGER NOT NULL,
        last_rank INTEGER NOT NULL,
        view TEXT NOT NULL,
        PRIMARY KEY (epoch_id, step, first_rank)
    );
    """,
    # 2 -> 3: running sums per epoch, kept in the transaction that stores the steps, so a job's
    # summary never scans its plans (reading past the large plan column is slow).
    """
    ALTER TABLE epochs ADD COLUMN sum_gap REAL NOT NULL DEFAULT 0;
    ALTER TABLE epochs ADD COLUMN sum_step_time_s REAL NOT NULL DEFAULT 0;
    ALTER TABLE epochs ADD COLUMN sum_speedup REAL NOT NULL DEFAULT 0;
    ALTER TABLE epochs ADD COLUMN num_speedup INTEGER NOT NULL DEFAULT 0;
    UPDATE epochs SET
        sum_gap = COALESCE((SELECT SUM(gap) FROM plans p WHERE p.epoch_id = epochs.id), 0),
        sum_step_time_s = COALESCE((SELECT SUM(predicted_step_time_s) FROM plans p
                                    WHERE p.epoch_id = epochs.id), 0),
        sum_speedup = COALESCE((SELECT SUM(speedup_vs_bucket) FROM plans p
                                WHERE p.epoch_id = epochs.id), 0),
        num_speedup = (SELECT COUNT(speedup_vs_bucket) FROM plans p WHERE p.epoch_id = epochs.id)
    """,
    # 3 -> 4: why a job failed matters for resuming it: a transient failure (a killed worker,
    # a full disk, a locked store) is retried with backoff, also after a restart.
    """
    ALTER TABLE epochs ADD COLUMN transient INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE epochs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0
    """,
    # 4 -> 5: closing the loop (api.measurements_store): what ranks measured per step, the
    # oldest folded per step and group when an epoch holds too many; immutable cost-model
    # revisions fitted from them; per epoch the recalibration settings, the last step any rank
    # fetched (steps up to it are frozen) and the revision each re-planned step was made with.
    """
    CREATE TABLE measurements (
        epoch_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        rank INTEGER NOT NULL,
        first_rank INTEGER NOT NULL,
        group_size INTEGER NOT NULL,
        digest TEXT NOT NULL,
        times_s TEXT NOT NULL,
        peak_bytes INTEGER,
        received_at REAL NOT NULL,
        PRIMARY KEY (epoch_id, step, rank)
    );
    CREATE TABLE measurement_groups (
        epoch_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        first_rank INTEGER NOT NULL,
        group_size INTEGER NOT NULL,
        digest TEXT NOT NULL,
        num_ranks INTEGER NOT NULL,
        times_s TEXT NOT NULL,
        peak_bytes INTEGER,
        PRIMARY KEY (epoch_id, step, first_rank)
    );
    CREATE TABLE cost_model_revisions (
        cost_model_id TEXT NOT NULL,
        rev INTEGER NOT NULL,
        body TEXT NOT NULL,
        digest TEXT NOT NULL,
        scales TEXT NOT NULL,
        fit TEXT NOT NULL,
        source_epoch TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (cost_model_id, rev)
    );
    CREATE TABLE epoch_recalibration (
        epoch_id TEXT PRIMARY KEY,
        follow INTEGER NOT NULL DEFAULT 0,
        every_steps INTEGER NOT NULL DEFAULT 0,
        frozen_through INTEGER NOT NULL DEFAULT -1,
        steps_at_fit INTEGER NOT NULL DEFAULT 0,
        current_rev INTEGER NOT NULL DEFAULT 0
    );
    CREATE TABLE step_revisions (
        epoch_id TEXT NOT NULL,
        step INTEGER NOT NULL,
        rev INTEGER NOT NULL,
        replanned_at REAL NOT NULL,
        PRIMARY KEY (epoch_id, step)
    );
    """,
    # 5 -> 6: measurements of one-off plans (POST /v1/plans answers are not stored): the plan
    # and its cluster kept once per digest, one row per rank (api.plan_measurements).
    """
    CREATE TABLE measured_plans (
        digest TEXT PRIMARY KEY,
        cost_model_id TEXT NOT NULL,
        cluster TEXT NOT NULL,
        plan TEXT NOT NULL,
        received_at REAL NOT NULL
    );
    CREATE TABLE plan_measurements (
        digest TEXT NOT NULL,
        rank INTEGER NOT NULL,
        first_rank INTEGER NOT NULL,
        group_size INTEGER NOT NULL,
        times_s TEXT NOT NULL,
        peak_bytes INTEGER,
        received_at REAL NOT NULL,
        PRIMARY KEY (digest, rank)
    );
    CREATE INDEX measured_plans_by_model ON measured_plans(cost_model_id, received_at)
    """,
    # 6 -> 7: the planner's wall time per stored step (the plan itself keeps 0 there, so equal
    # inputs store equal bytes; the dashboard shows how long each step took to plan).
    """
    ALTER TABLE plans ADD COLUMN solve_time_s REAL
    """,
    # 7 -> 8: the headline comparison, per step and as running sums: the strongest baseline's
    # predicted time (naive excepted, planner.baselines.strongest) over the plan's; backfilled from
    # each stored plan's baselines_s.
    """
    ALTER TABLE plans ADD COLUMN speedup_vs_strongest REAL;
    ALTER TABLE epochs ADD COLUMN sum_speedup_strongest REAL NOT NULL DEFAULT 0;
    ALTER TABLE epochs ADD COLUMN num_speedup_strongest INTEGER NOT NULL DEFAULT 0;
    UPDATE plans SET speedup_vs_strongest = (
        SELECT min(b.value) FROM json_each(plans.plan, '$.baselines_s') b WHERE b.key != 'naive'
    ) / predicted_step_time_s WHERE predicted_step_time_s > 0;
    UPDATE epochs SET
        sum_speedup_strongest = (SELECT coalesce(sum(speedup_vs_strongest), 0) FROM plans
                                 WHERE plans.epoch_id = epochs.id),
        num_speedup_strongest = (SELECT count(speedup_vs_strongest) FROM plans WHERE plans.epoch_id = epochs.id)
    """,
]


def connect(path: Path, *, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection in autocommit mode (explicit transactions), WAL, rows by name.

    ``synchronous=FULL``: every commit is on disk before it returns, so a stored plan or job
    survives an operating-system crash or a file system that aborts its journal (with NORMAL,
    WAL commits since the last checkpoint were lost: bench/faults.py, the read-only case).
    """
    conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


class ThreadConnections:
    """One connection per thread and name (opened on first use), all closed together."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[sqlite3.Connection] = []

    def get(self, name: str, open_conn: Callable[[], sqlite3.Connection]) -> sqlite3.Connection:
        """This thread's connection ``name``, opened by ``open_conn`` the first time."""
        conn: sqlite3.Connection | None = getattr(self._local, name, None)
        if conn is None:
            conn = open_conn()
            setattr(self._local, name, conn)
            with self._lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Close every connection opened through this object."""
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; on error, roll back if SQLite has not already done so.

    SQLite rolls a transaction back by itself on some errors (``SQLITE_FULL``, some I/O
    errors); an unconditional ``ROLLBACK`` would then raise ``cannot rollback - no transaction
    is active`` and hide the real cause. The original error is always the one raised.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                logger.warning("rollback failed after an error: %s", exc)
        raise


def schema_version(conn: sqlite3.Connection) -> int:
    """The schema version of the file (0 for an empty file)."""
    exists = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone()
    if not exists:
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return int(row["value"]) if row else 0


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Create the schema or bring it up to ``STORE_SCHEMA_VERSION``.

    Raises:
        ValueError: when the file was written by a newer version.
    """
    version = schema_version(conn)
    if version > STORE_SCHEMA_VERSION:
        raise ValueError(f"store {path} has schema version {version}, newer than "
                         f"this program's {STORE_SCHEMA_VERSION}")
    if version < STORE_SCHEMA_VERSION:
        logger.info("%s store %s (schema version %d -> %d)", "creating" if version == 0 else "migrating",
                    path, version, STORE_SCHEMA_VERSION)
    for target in range(version, STORE_SCHEMA_VERSION):
        logger.debug("store %s: schema version %d", path, target + 1)
        with transaction(conn):
            for statement in _MIGRATIONS[target].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                         (str(target + 1),))
