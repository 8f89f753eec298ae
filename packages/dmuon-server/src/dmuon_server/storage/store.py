"""SQLite persistence: jobs, state transitions with reasons, metrics and file offsets.

One connection per :class:`Store`, shared by threads under a lock; WAL journal and a busy
timeout so that readers never block the writer and a second process (a restarted server,
a ``sqlite3`` shell) waits instead of failing. Every write that must be atomic (a job and
its first transition; a batch of metric points and the file offset after them) is one
``BEGIN IMMEDIATE`` transaction.
"""

from __future__ import annotations

from dmuon_server.storage.attempts import AttemptsTable
from dmuon_server.storage.database import StoreError, StoreFull, StoreUnavailable
from dmuon_server.storage.jobs import IdempotencyConflict, JobsTable
from dmuon_server.storage.points import EventRecord, PointsTable
from dmuon_server.storage.summary import MetricSummary

__all__ = [
    "EventRecord",
    "IdempotencyConflict",
    "MetricSummary",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
]


class Store(JobsTable, AttemptsTable, PointsTable):
    """Thread-safe access to the server's SQLite database, one class per table group
    (`JobsTable`, `AttemptsTable`, `PointsTable`) over one `Database`.

    Writes go through one connection under a lock; reads use a connection per thread
    (WAL lets them run while a write is in progress), so a view never waits for the
    metrics ingester.
    """
