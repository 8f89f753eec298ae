"""The connection to the server's SQLite database: opening, creating and migrating it,
transactions, per-thread readers, and the errors it raises.

One write connection, shared by threads under a lock; WAL journal and a busy timeout so
that readers never block the writer and a second process (a restarted server, a
``sqlite3`` shell) waits instead of failing. Every write that must be atomic is one
``BEGIN IMMEDIATE`` transaction (:meth:`Database._tx`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dmuon_server.storage.schema import (
    ADDED_COLUMNS,
    INDEXES,
    JOBS_TABLE,
    METRICS_TABLE,
    SCHEMA,
    SCHEMA_VERSION,
    V1_JOB_COLUMNS,
)
from dmuon_server.storage.summary import summary_from_points, write_summary

log = logging.getLogger("dmuon_server.storage")


class StoreError(Exception):
    """The database cannot be opened or used; the message names the file."""


class StoreUnavailable(StoreError):
    """A read or write failed in SQLite (an I/O error, say); nothing was half-written."""


class StoreFull(StoreUnavailable):
    """A write failed because the database's disk is full ("database or disk is full")."""


#: SQLite's result code for "database or disk is full".
_SQLITE_FULL = 13


class Database:
    """Thread-safe access to the database (the tables' methods build on it)."""

    def __init__(self, path: Path) -> None:
        """Open (and create or migrate) the database at ``path``.

        Raises :class:`StoreError`, naming the file, when it cannot be opened or is not
        a database.
        """
        self.path = path
        self._lock = threading.RLock()
        #: Counts committed changes of the jobs table (a job created, changed, reopened,
        #: deleted; not its metrics): what the queue's places are cached under. Read it
        #: before computing from the store, so that a change committed meanwhile makes the
        #: next reader compute again.
        self.version = 0
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                str(path), timeout=30.0, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as e:
            raise StoreError(f"cannot open the database {path}: {e}") from None
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA busy_timeout=30000")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            fresh = not self._conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'jobs'"
            ).fetchone()
            for stmt in SCHEMA.strip().split(";"):
                if stmt.strip():
                    self._conn.execute(stmt)
            self._add_missing_columns()
            self._conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION if fresh else 1),),
            )
            if self._schema_version() < 2:
                self._migrate_to_v2()
            for stmt in INDEXES.strip().split(";"):
                self._conn.execute(stmt)
        except sqlite3.Error as e:
            self._conn.close()
            raise StoreError(
                f"cannot use the database {path}: {e}; restore it from a backup or move it "
                "away to start with an empty one"
            ) from None

    def _schema_version(self) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return int(row[0]) if row else 1

    def _add_missing_columns(self) -> None:
        """Add the columns later versions introduced to a database an older one created."""
        for table, column, decl in ADDED_COLUMNS:
            have = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    def _migrate_to_v2(self) -> None:
        """Rebuild the jobs table of a version-1 database (per-user idempotency keys, the
        new columns), move its points into the rowid table, summarise every job, and give
        the freed pages back to the file system (``VACUUM``)."""
        log.info("migrating %s to schema version 2 (once; may take a while)", self.path)
        with self._tx() as c:
            if "queue_seq" not in {r[1] for r in c.execute("PRAGMA table_info(jobs)")}:
                c.execute("ALTER TABLE jobs RENAME TO jobs_v1")
                c.execute(JOBS_TABLE)
                c.execute(
                    f"INSERT INTO jobs ({V1_JOB_COLUMNS}, queue_seq)"
                    f" SELECT {V1_JOB_COLUMNS}, seq FROM jobs_v1"
                )
                c.execute("DROP TABLE jobs_v1")
            cols = {r[1] for r in c.execute("PRAGMA table_info(metrics)")}
            if "loss" in cols:  # the version-1 table: WITHOUT ROWID, with a loss column
                c.execute("ALTER TABLE metrics RENAME TO metrics_v1")
                c.execute(METRICS_TABLE)
                c.execute(
                    "INSERT INTO metrics (job, step, data, received_at)"
                    " SELECT j.seq, m.step, m.data, m.received_at FROM metrics_v1 m"
                    " JOIN jobs j ON j.id = m.job_id"
                )
                c.execute("DROP TABLE metrics_v1")
            for (job_id,) in c.execute("SELECT id FROM jobs").fetchall():
                write_summary(c, job_id, summary_from_points(c, job_id))
            c.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
        self._conn.execute("VACUUM")

    def _reader(self) -> sqlite3.Connection:
        """This thread's read connection (opened on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(str(self.path), timeout=30.0, isolation_level=None)
            except sqlite3.Error as e:
                raise StoreError(f"cannot open the database {self.path}: {e}") from None
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA query_only=ON")
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    def refresh_spec_hashes(self, fingerprint: Callable[[str], str | None], prefix: str) -> int:
        """Recompute the spec hash of every job with an idempotency key whose hash does not
        start with ``prefix`` (written by an older server), as ``fingerprint(spec JSON)``;
        a ``None`` fingerprint leaves the row alone. Returns the number of rows changed."""
        changed = 0
        with self._tx() as c:
            rows = c.execute(
                "SELECT id, spec FROM jobs WHERE idempotency_key IS NOT NULL"
                " AND substr(spec_hash, 1, ?) != ?",
                (len(prefix), prefix),
            ).fetchall()
            for row in rows:
                new = fingerprint(row["spec"])
                if new is not None:
                    c.execute("UPDATE jobs SET spec_hash = ? WHERE id = ?", (new, row["id"]))
                    changed += 1
        return changed

    def close(self) -> None:
        """Close the connections (the read connections of every thread too)."""
        with self._lock:
            self._conn.close()
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()

    @contextmanager
    def _tx(self, jobs_changed: bool = False) -> Iterator[sqlite3.Connection]:
        """Run the body as one ``BEGIN IMMEDIATE`` transaction under the lock.

        SQLite's own errors (a full disk, an I/O error) leave nothing half-written and are
        raised as :class:`StoreFull` or :class:`StoreUnavailable`, naming the database.
        """
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    self._rollback()
                    raise
                try:
                    self._conn.execute("COMMIT")
                    if jobs_changed:
                        self.version += 1
                except BaseException:
                    self._rollback()
                    raise
            except sqlite3.OperationalError as e:
                raise self._unavailable(e) from e

    def _rollback(self) -> None:
        if self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _unavailable(self, e: sqlite3.Error) -> StoreUnavailable:
        """The error to raise for SQLite's ``e``: :class:`StoreFull` for a full disk."""
        code = getattr(e, "sqlite_errorcode", None)
        if code == _SQLITE_FULL or "disk is full" in str(e):
            try:
                free = f"{shutil.disk_usage(self.path.parent).free / 2**20:.1f} MiB free"
            except OSError:
                free = "free space unknown"
            return StoreFull(
                f"the server's database {self.path.name} cannot be written: its disk is full "
                f"({free} in the data directory). Free space there (delete finished jobs "
                "or their checkpoints), then try again"
            )
        return StoreUnavailable(f"the server's database {self.path.name} failed: {e}")

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        try:
            return [dict(r) for r in self._reader().execute(sql, params).fetchall()]
        except sqlite3.OperationalError as e:
            raise self._unavailable(e) from e
