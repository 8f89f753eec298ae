"""A job's metric summary: what its views show of its points, kept current at ingest."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import astuple, dataclass
from typing import Any

from dmuon_server.storage.schema import SUMMARY_COLUMNS, job_seq


@dataclass
class MetricSummary:
    """What a job's views show of its stored points, kept current at every ingest.

    Values of the metrics contract (``time``, ``tokens_per_s``, ``loss``, ``val_loss``)
    are as stored: a number, an encoded non-finite (``"NaN"``...), or None.
    """

    points: int = 0
    first_step: int | None = None
    first_time: Any = None
    first_received_at: float | None = None
    last_step: int | None = None
    last_time: Any = None
    last_tokens_per_s: Any = None
    last_received_at: float | None = None
    last_loss: Any = None
    last_loss_step: int | None = None
    first_val_loss: Any = None
    first_val_step: int | None = None
    last_val_loss: Any = None
    last_val_step: int | None = None
    rejected_lines: int = 0

    def add(self, step: int, data: dict[str, Any], received_at: float, *, new: bool) -> bool:
        """Take the (merged) point of ``step`` into account.

        Returns False when the summary cannot follow incrementally (a merge made a
        tracked value null) and must be recomputed from the stored points.
        """
        if new:
            self.points += 1
        if self.first_step is None or step < self.first_step:
            self.first_step, self.first_received_at = step, received_at
        if step == self.first_step:
            self.first_time = data.get("time")
        if self.last_step is None or step > self.last_step:
            self.last_step, self.last_received_at = step, received_at
        if step == self.last_step:
            self.last_time, self.last_tokens_per_s = data.get("time"), data.get("tokens_per_s")
        ok = True
        loss, val = data.get("loss"), data.get("val_loss")
        if loss is not None:
            if self.last_loss_step is None or step >= self.last_loss_step:
                self.last_loss, self.last_loss_step = loss, step
        elif step == self.last_loss_step:
            ok = False
        if val is not None:
            if self.last_val_step is None or step >= self.last_val_step:
                self.last_val_loss, self.last_val_step = val, step
            if self.first_val_step is None or step <= self.first_val_step:
                self.first_val_loss, self.first_val_step = val, step
        elif step in (self.first_val_step, self.last_val_step):
            ok = False
        return ok


def read_summary(c: sqlite3.Connection, job_id: str) -> MetricSummary:
    """The stored summary of a job (an empty one before its first point)."""
    row = c.execute(
        f"SELECT {', '.join(SUMMARY_COLUMNS)} FROM summaries WHERE job_id = ?", (job_id,)
    ).fetchone()
    return MetricSummary(*row) if row is not None else MetricSummary()


def write_summary(c: sqlite3.Connection, job_id: str, summary: MetricSummary) -> None:
    """Store a job's summary."""
    cols = ", ".join(SUMMARY_COLUMNS)
    marks = ", ".join("?" * len(SUMMARY_COLUMNS))
    c.execute(
        f"INSERT OR REPLACE INTO summaries (job_id, {cols}) VALUES (?, {marks})",
        (job_id, *astuple(summary)),
    )


def summary_from_points(c: sqlite3.Connection, job_id: str) -> MetricSummary:
    """The summary of a job computed from all its stored points (a scan: used when
    points are dropped, and when an old database is migrated)."""
    summary = MetricSummary()
    for row in c.execute(
        "SELECT step, data, received_at FROM metrics WHERE job = ? ORDER BY step",
        (job_seq(c, job_id),),
    ):
        summary.add(row["step"], json.loads(row["data"]), row["received_at"], new=True)
    return summary
