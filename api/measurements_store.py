"""Measured step times in the plan store: one row per step and rank, the oldest folded per group.

An epoch keeps at most ``max_rows_per_epoch`` rank rows. Past that, the rows of its oldest
steps are folded, per step and group, into one ``measurement_groups`` row: the median over the
group's ranks of each micro-batch's time (what the recalibration fits on anyway), the largest
peak and the number of ranks. Nothing the fit uses is lost, and the fold is logged. Every write
is one transaction (``api.store_schema.transaction``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from api.store import PlanStore
from api.store_schema import transaction

logger = logging.getLogger(__name__)

MAX_ROWS_PER_EPOCH = 20_000
"""Rank rows an epoch keeps before its oldest steps are folded per group."""
FOLD_TO_FRACTION = 0.75
"""A fold leaves at most this share of ``max_rows_per_epoch`` rank rows."""


@dataclass(kw_only=True, frozen=True, slots=True)
class RankMeasurement:
    """One rank's measurements of one step, checked against the stored plan."""

    step: int
    """Step index."""
    rank: int
    """The rank."""
    first_rank: int
    """First rank of its group in the plan."""
    group_size: int
    """Size of its group."""
    digest: str
    """Digest of the plan that ran."""
    times_s: tuple[float, ...]
    """Seconds per micro-batch of the group, in plan order."""
    peak_bytes: int | None
    """Peak bytes of the step on the rank, when the device reports one."""


@dataclass(kw_only=True, frozen=True, slots=True)
class GroupMeasurement:
    """A group's micro-batch times in one step: the median over its ranks that reported."""

    step: int
    """Step index."""
    first_rank: int
    """First rank of the group."""
    group_size: int
    """Group size."""
    digest: str
    """Digest of the plan that ran."""
    times_s: tuple[float, ...]
    """Seconds per micro-batch (median over the reporting ranks)."""
    num_ranks: int
    """Ranks that reported."""
    peak_bytes: int | None
    """Largest peak reported, if any."""


def _median_times(rows: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(statistics.median(values) for values in zip(*rows, strict=True))


class MeasurementStore:
    """Queries of the measurement tables (thread-safe like the store it wraps)."""

    def __init__(self, store: PlanStore, *, max_rows_per_epoch: int = MAX_ROWS_PER_EPOCH) -> None:
        if max_rows_per_epoch < 1:
            raise ValueError(f"max_rows_per_epoch must be at least 1, got {max_rows_per_epoch}")
        self.store = store
        self.max_rows_per_epoch = max_rows_per_epoch

    def add(self, epoch_id: str, rows: Sequence[RankMeasurement]) -> tuple[int, int]:
        """Store rank rows (a step a rank already reported is left as it was: posts are idempotent).

        Returns:
            ``(rows stored, duplicates ignored)``.
        """
        now = time.time()
        with transaction(self.store._conn()) as conn:
            stored = 0
            for r in rows:
                cur = conn.execute(
                    "INSERT OR IGNORE INTO measurements(epoch_id, step, rank, first_rank, group_size, "
                    "digest, times_s, peak_bytes, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (epoch_id, r.step, r.rank, r.first_rank, r.group_size, r.digest,
                     json.dumps(list(r.times_s)), r.peak_bytes, now))
                stored += cur.rowcount
            count = conn.execute("SELECT COUNT(*) AS n FROM measurements WHERE epoch_id=?",
                                 (epoch_id,)).fetchone()["n"]
            if count > self.max_rows_per_epoch:
                self._fold(conn, epoch_id, count)
        return stored, len(rows) - stored

    def _fold(self, conn: sqlite3.Connection, epoch_id: str, count: int) -> None:
        keep = int(self.max_rows_per_epoch * FOLD_TO_FRACTION)
        steps = [r["step"] for r in conn.execute(
            "SELECT step, COUNT(*) AS n FROM measurements WHERE epoch_id=? GROUP BY step ORDER BY step",
            (epoch_id,)).fetchall()]
        per_step = {r["step"]: r["n"] for r in conn.execute(
            "SELECT step, COUNT(*) AS n FROM measurements WHERE epoch_id=? GROUP BY step", (epoch_id,))}
        fold: list[int] = []
        left = count
        for step in steps:
            if left <= keep:
                break
            fold.append(step)
            left -= per_step[step]
        for step in fold:
            groups: dict[int, list[sqlite3.Row]] = {}
            for row in conn.execute("SELECT * FROM measurements WHERE epoch_id=? AND step=?",
                                    (epoch_id, step)).fetchall():
                groups.setdefault(row["first_rank"], []).append(row)
            for first_rank, members in groups.items():
                self._fold_group(conn, epoch_id, step, first_rank, members)
            conn.execute("DELETE FROM measurements WHERE epoch_id=? AND step=?", (epoch_id, step))
        logger.info("epoch %s: %d measurement rows over the limit of %d; folded steps %d..%d per group",
                    epoch_id, count, self.max_rows_per_epoch, fold[0], fold[-1])

    @staticmethod
    def _fold_group(conn: sqlite3.Connection, epoch_id: str, step: int, first_rank: int,
                    rows: list[sqlite3.Row]) -> None:
        times = _median_times([tuple(json.loads(m["times_s"])) for m in rows])
        peaks = [m["peak_bytes"] for m in rows if m["peak_bytes"] is not None]
        n = len(rows)
        old = conn.execute("SELECT num_ranks, times_s, peak_bytes FROM measurement_groups "
                           "WHERE epoch_id=? AND step=? AND first_rank=?",
                           (epoch_id, step, first_rank)).fetchone()
        if old is not None:  # late ranks of a folded step: weighted mean of the two medians
            old_times = json.loads(old["times_s"])
            total = old["num_ranks"] + n
            times = tuple((a * old["num_ranks"] + b * n) / total
                          for a, b in zip(old_times, times, strict=True))
            if old["peak_bytes"] is not None:
                peaks.append(old["peak_bytes"])
            n = total
        conn.execute(
            "INSERT OR REPLACE INTO measurement_groups(epoch_id, step, first_rank, group_size, digest, "
            "num_ranks, times_s, peak_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (epoch_id, step, first_rank, rows[0]["group_size"], rows[0]["digest"], n,
             json.dumps(list(times)), max(peaks) if peaks else None))

    def groups(self, epoch_id: str) -> list[GroupMeasurement]:
        """Every measured group of the epoch, by step then first rank (folded and recent rows)."""
        conn = self.store._conn()
        found: dict[tuple[int, int], GroupMeasurement] = {}
        for row in conn.execute("SELECT * FROM measurement_groups WHERE epoch_id=?", (epoch_id,)):
            found[(row["step"], row["first_rank"])] = GroupMeasurement(
                step=row["step"], first_rank=row["first_rank"], group_size=row["group_size"],
                digest=row["digest"], times_s=tuple(json.loads(row["times_s"])),
                num_ranks=row["num_ranks"], peak_bytes=row["peak_bytes"])
        raw: dict[tuple[int, int], list[sqlite3.Row]] = {}
        for row in conn.execute("SELECT * FROM measurements WHERE epoch_id=?", (epoch_id,)):
            raw.setdefault((row["step"], row["first_rank"]), []).append(row)
        for key, members in raw.items():
            if key in found:
                continue  # the step's group was folded; late rows join it at the next fold
            peaks = [m["peak_bytes"] for m in members if m["peak_bytes"] is not None]
            found[key] = GroupMeasurement(
                step=key[0], first_rank=key[1], group_size=members[0]["group_size"],
                digest=members[0]["digest"],
                times_s=_median_times([tuple(json.loads(m["times_s"])) for m in members]),
                num_ranks=len(members), peak_bytes=max(peaks) if peaks else None)
        return [found[k] for k in sorted(found)]

    def num_rows(self, epoch_id: str) -> int:
        """Rank rows stored (not folded) for the epoch."""
        return int(self.store._conn().execute("SELECT COUNT(*) AS n FROM measurements WHERE epoch_id=?",
                                              (epoch_id,)).fetchone()["n"])

    def measured_steps(self, epoch_id: str) -> int:
        """Distinct steps with at least one measurement (folded or not)."""
        row = self.store._conn().execute(
            "SELECT COUNT(*) AS n FROM (SELECT step FROM measurements WHERE epoch_id=? UNION "
            "SELECT step FROM measurement_groups WHERE epoch_id=?)", (epoch_id, epoch_id)).fetchone()
        return int(row["n"])
