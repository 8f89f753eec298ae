"""A job's metric points, the recipe's events and the metrics files' offsets: what the
ingester writes and the views and streams read."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dmuon_recipe_contract import CHECKPOINT_SKIPPED_EVENT as CHECKPOINT_SKIPPED_KIND

from dmuon_server.storage.database import Database
from dmuon_server.storage.records import PointRecord, StoredEvent
from dmuon_server.storage.schema import job_seq
from dmuon_server.storage.summary import (
    MetricSummary,
    read_summary,
    summary_from_points,
    write_summary,
)


@dataclass(frozen=True)
class EventRecord:
    """An event the recipe wrote into its metrics file, as the job keeps it.

    Attributes:
        attempt: The attempt whose file held it.
        kind: The recipe's ``event`` (``checkpoint_skipped``, ``checkpoint_failed``, ...).
        level: ``warning`` or ``info``.
        message: What happened, in one line a person reads.
        step: The step it concerns, when it names one.
    """

    attempt: int
    kind: str
    level: str
    message: str
    step: int | None = None


class PointsTable(Database):
    """Metric points, recipe events and file offsets."""

    def events(self, job_id: str, after_id: int = 0) -> list[StoredEvent]:
        """A job's recipe events with ``id > after_id``, oldest first."""
        rows = self._query(
            "SELECT id, attempt, kind, level, message, step, at FROM events"
            " WHERE job_id = ? AND id > ? ORDER BY id",
            (job_id, after_id),
        )
        return [StoredEvent.from_row(r) for r in rows]

    def get_offset(self, job_id: str, stream: str) -> int:
        """Return how many bytes of a job's file were consumed (0 at first)."""
        rows = self._query(
            "SELECT byte_offset FROM offsets WHERE job_id = ? AND stream = ?", (job_id, stream)
        )
        return int(rows[0]["byte_offset"]) if rows else 0

    def stored_metrics_bytes(self, job_id: str) -> int:
        """Bytes a job's stored metric points and events take (their text)."""
        rows = self._query(
            "SELECT (SELECT COALESCE(SUM(LENGTH(m.data)), 0) FROM metrics m JOIN jobs j "
            "ON m.job = j.seq WHERE j.id = ?) + (SELECT COALESCE(SUM(LENGTH(message)), 0) "
            "FROM events WHERE job_id = ?) AS n",
            (job_id, job_id),
        )
        return int(rows[0]["n"]) if rows else 0

    def ingest(
        self,
        job_id: str,
        stream: str,
        new_offset: int,
        points: Sequence[tuple[int, dict[str, Any]]],
        recipe_summary: dict[str, Any] | None = None,
        rejected: int = 0,
        events: Sequence[EventRecord] = (),
    ) -> int:
        """Store metric points and the file offset after them in one transaction.

        ``points`` are ``(step, data)``; ``data`` must already be strict JSON
        (non-finite floats encoded). A step seen before is merged key by key (a recipe may
        report the eval of a step on its own line), so re-reading never duplicates. The
        job's summary (:meth:`metric_summary`) follows in the same transaction, with
        ``rejected`` more lines counted as rejected; so do the recipe's ``events`` read
        from the same lines (stored once, like the points). A ``checkpoint_skipped`` event
        of a resumed attempt carries the step the recipe resumed from instead (a damaged
        newest checkpoint passed over): the attempt's ``resumed_from_step`` becomes it.
        Returns the number of points written.
        """
        now = time.time()
        written = 0
        with self._tx() as c:
            seq = job_seq(c, job_id)
            if seq is None:  # deleted meanwhile
                return 0
            summary = read_summary(c, job_id)
            exact = True
            for step, data in points:
                old = c.execute(
                    "SELECT data, received_at FROM metrics WHERE job = ? AND step = ?",
                    (seq, step),
                ).fetchone()
                if old is None:
                    c.execute(
                        "INSERT INTO metrics (job, step, data, received_at) VALUES (?, ?, ?, ?)",
                        (seq, step, json.dumps(data, allow_nan=False), now),
                    )
                    exact = summary.add(step, data, now, new=True) and exact
                else:
                    merged = {**json.loads(old["data"]), **data}
                    c.execute(
                        "UPDATE metrics SET data = ? WHERE job = ? AND step = ?",
                        (json.dumps(merged, allow_nan=False), seq, step),
                    )
                    exact = summary.add(step, merged, old["received_at"], new=False) and exact
                written += 1
            if not exact:
                rejected += summary.rejected_lines
                summary = summary_from_points(c, job_id)
            summary.rejected_lines += rejected
            if points or rejected or not exact:
                write_summary(c, job_id, summary)
            c.execute(
                "INSERT INTO offsets (job_id, stream, byte_offset) VALUES (?, ?, ?)"
                " ON CONFLICT (job_id, stream) DO UPDATE SET byte_offset = excluded.byte_offset",
                (job_id, stream, new_offset),
            )
            for ev in events:
                c.execute(
                    "INSERT INTO events (job_id, attempt, kind, level, message, step, at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job_id, ev.attempt, ev.kind, ev.level, ev.message, ev.step, now),
                )
                if ev.kind == CHECKPOINT_SKIPPED_KIND and ev.step is not None:
                    # The recipe resumed from an older checkpoint than the newest on disk
                    # (the one the attempt was recorded with): its step, or none at step 0.
                    c.execute(
                        "UPDATE attempts SET resumed_from_step = ?"
                        " WHERE job_id = ? AND number = ? AND resumed_from_step > ?",
                        (ev.step or None, job_id, ev.attempt, ev.step),
                    )
            if recipe_summary is not None:
                c.execute(
                    "UPDATE jobs SET recipe_summary = ? WHERE id = ?",
                    (json.dumps(recipe_summary, allow_nan=False), job_id),
                )
        return written

    def metric_summary(self, job_id: str) -> MetricSummary:
        """What the views show of a job's points (one row, whatever their number)."""
        return read_summary(self._reader(), job_id)

    def metrics_after(self, job_id: str, after_step: int, limit: int) -> list[PointRecord]:
        """Up to ``limit`` points with ``step > after_step``, in step order."""
        rows = self._query(
            "SELECT m.step, m.data, m.received_at FROM metrics m JOIN jobs j ON m.job = j.seq"
            " WHERE j.id = ? AND m.step > ?"
            " ORDER BY m.step LIMIT ?",
            (job_id, after_step, limit),
        )
        return [PointRecord(r["step"], r["data"], r["received_at"]) for r in rows]
