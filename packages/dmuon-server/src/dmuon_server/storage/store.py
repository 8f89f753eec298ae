"""SQLite persistence: jobs, state transitions with reasons, metrics and file offsets.

One connection per :class:`Store`, shared by threads under a lock; WAL journal and a busy
timeout so that readers never block the writer and a second process (a restarted server,
a ``sqlite3`` shell) waits instead of failing. Every write that must be atomic (a job and
its first transition; a batch of metric points and the file offset after them) is one
``BEGIN IMMEDIATE`` transaction.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from dmuon_recipe_contract import CHECKPOINT_SKIPPED_EVENT as CHECKPOINT_SKIPPED_KIND

from dmuon_server.schemas import TERMINAL_STATES
from dmuon_server.storage.records import AttemptRecord, JobRecord

log = logging.getLogger("dmuon_server.storage.store")

#: Version 2: metric points in a rowid table (a point of 1 KB fits its page instead of
#: spilling into overflow pages), a summary row per job kept current at ingest; jobs with
#: their queue order apart from their creation order, their user (idempotency keys are per
#: user), priority and devices.
SCHEMA_VERSION = 2

#: Metric points: a rowid table, whose rows keep up to about 4 KB on their page (a
#: WITHOUT ROWID row above about 1 KB spills into overflow pages of its own), keyed by the
#: job's ``seq`` (a few bytes) rather than its 32-character id.
_METRICS_TABLE = """
CREATE TABLE IF NOT EXISTS metrics (
    job INTEGER NOT NULL,
    step INTEGER NOT NULL,
    data TEXT NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (job, step)
)"""

#: Jobs. An idempotency key is unique per user (index ``jobs_by_key``).
_JOBS_TABLE = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    name TEXT,
    state TEXT NOT NULL,
    nproc INTEGER NOT NULL,
    spec TEXT NOT NULL,
    spec_hash TEXT NOT NULL,
    idempotency_key TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    exit_code INTEGER,
    reason TEXT,
    pid INTEGER,
    pgid INTEGER,
    create_time REAL,
    cancel_requested_at REAL,
    failure TEXT,
    recipe_summary TEXT,
    argv TEXT,
    slurm_job_id TEXT,
    queue_seq INTEGER,
    user TEXT,
    priority INTEGER NOT NULL DEFAULT 0,
    gpus TEXT
)"""
#: Indexes on columns a version-1 database gains only when it is migrated.
_INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, priority, queue_seq);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_key ON jobs (COALESCE(user, ''), idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_by_user ON jobs (user, seq)
"""
#: The columns of a version-1 ``jobs`` table.
_V1_JOB_COLUMNS = (
    "seq, id, name, state, nproc, spec, spec_hash, idempotency_key, created_at, started_at,"
    " finished_at, exit_code, reason, pid, pgid, create_time, cancel_requested_at, failure,"
    " recipe_summary, argv, slurm_job_id"
)

_SCHEMA = (
    _METRICS_TABLE
    + ";\n"
    + _JOBS_TABLE
    + """;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS transitions_by_job ON transitions (job_id, id);
CREATE TABLE IF NOT EXISTS summaries (
    job_id TEXT PRIMARY KEY,
    points INTEGER NOT NULL DEFAULT 0,
    first_step INTEGER,
    first_time,
    first_received_at REAL,
    last_step INTEGER,
    last_time,
    last_tokens_per_s,
    last_received_at REAL,
    last_loss,
    last_loss_step INTEGER,
    first_val_loss,
    first_val_step INTEGER,
    last_val_loss,
    last_val_step INTEGER,
    rejected_lines INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL,
    number INTEGER NOT NULL,
    cause TEXT NOT NULL,
    resumed_from_step INTEGER,
    started_at REAL NOT NULL,
    finished_at REAL,
    exit_code INTEGER,
    reason TEXT,
    slurm_job_id TEXT,
    PRIMARY KEY (job_id, number)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    kind TEXT NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    step INTEGER,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS offsets (
    job_id TEXT NOT NULL,
    stream TEXT NOT NULL,
    byte_offset INTEGER NOT NULL,
    PRIMARY KEY (job_id, stream)
) WITHOUT ROWID;
"""
)


#: Columns added to version 1 after its first release: (table, column, declaration).
_ADDED_COLUMNS = (("jobs", "slurm_job_id", "TEXT"), ("attempts", "slurm_job_id", "TEXT"))
#: The summary columns, in the order of :class:`MetricSummary`'s fields.
_SUMMARY_COLUMNS = (
    "points",
    "first_step",
    "first_time",
    "first_received_at",
    "last_step",
    "last_time",
    "last_tokens_per_s",
    "last_received_at",
    "last_loss",
    "last_loss_step",
    "first_val_loss",
    "first_val_step",
    "last_val_loss",
    "last_val_step",
    "rejected_lines",
)


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


def _seq(c: sqlite3.Connection, job_id: str) -> int | None:
    """The ``seq`` of a job (the key of its metric points), or None for an unknown job."""
    row = c.execute("SELECT seq FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return int(row[0]) if row else None


def _next_queue_seq(c: sqlite3.Connection) -> int:
    """The queue position after every job queued so far (a job joins at the end)."""
    return int(c.execute("SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs").fetchone()[0])


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


class IdempotencyConflict(Exception):
    """The idempotency key is already bound to a job with a different spec."""

    def __init__(self, job_id: str) -> None:
        """Remember the job the key belongs to."""
        super().__init__(job_id)
        self.job_id = job_id


class StoreError(Exception):
    """The database cannot be opened or used; the message names the file."""


class StoreUnavailable(StoreError):
    """A read or write failed in SQLite (an I/O error, say); nothing was half-written."""


class StoreFull(StoreUnavailable):
    """A write failed because the database's disk is full ("database or disk is full")."""


#: SQLite's result code for "database or disk is full".
_SQLITE_FULL = 13


class Store:
    """Thread-safe access to the server's SQLite database.

    Writes go through one connection under a lock; reads use a connection per thread
    (WAL lets them run while a write is in progress), so a view never waits for the
    metrics ingester.
    """

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
            for stmt in _SCHEMA.strip().split(";"):
                if stmt.strip():
                    self._conn.execute(stmt)
            self._add_missing_columns()
            self._conn.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION if fresh else 1),),
            )
            if self._schema_version() < 2:
                self._migrate_to_v2()
            for stmt in _INDEXES.strip().split(";"):
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
        for table, column, decl in _ADDED_COLUMNS:
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
                c.execute(_JOBS_TABLE)
                c.execute(
                    f"INSERT INTO jobs ({_V1_JOB_COLUMNS}, queue_seq)"
                    f" SELECT {_V1_JOB_COLUMNS}, seq FROM jobs_v1"
                )
                c.execute("DROP TABLE jobs_v1")
            cols = {r[1] for r in c.execute("PRAGMA table_info(metrics)")}
            if "loss" in cols:  # the version-1 table: WITHOUT ROWID, with a loss column
                c.execute("ALTER TABLE metrics RENAME TO metrics_v1")
                c.execute(_METRICS_TABLE)
                c.execute(
                    "INSERT INTO metrics (job, step, data, received_at)"
                    " SELECT j.seq, m.step, m.data, m.received_at FROM metrics_v1 m"
                    " JOIN jobs j ON j.id = m.job_id"
                )
                c.execute("DROP TABLE metrics_v1")
            for (job_id,) in c.execute("SELECT id FROM jobs").fetchall():
                self._write_summary(c, job_id, self._summary_from_points(c, job_id))
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

    # ----------------------------------------------------------------------------- jobs

    def create_job(
        self,
        *,
        job_id: str,
        name: str | None,
        nproc: int,
        spec: str,
        spec_hash: str,
        idempotency_key: str | None,
        argv: list[str],
        user: str | None = None,
        priority: int = 0,
    ) -> tuple[JobRecord, bool]:
        """Insert a queued job, or return the one ``user`` bound to ``idempotency_key``.

        Returns the job and whether it was created. Raises :class:`IdempotencyConflict`
        when the key belongs to a job of the same user with another spec.
        """
        now = time.time()
        with self._tx(jobs_changed=True) as c:
            if idempotency_key is not None:
                row = c.execute(
                    "SELECT * FROM jobs WHERE idempotency_key = ? AND COALESCE(user, '') = ?",
                    (idempotency_key, user or ""),
                ).fetchone()
                if row is not None:
                    if row["spec_hash"] != spec_hash:
                        raise IdempotencyConflict(row["id"])
                    return JobRecord.from_row(row), False
            c.execute(
                "INSERT INTO jobs (id, name, state, nproc, spec, spec_hash, idempotency_key,"
                " created_at, reason, argv, queue_seq, user, priority)"
                " VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    name,
                    nproc,
                    spec,
                    spec_hash,
                    idempotency_key,
                    now,
                    "submitted",
                    json.dumps(argv),
                    _next_queue_seq(c),
                    user,
                    priority,
                ),
            )
            c.execute(
                "INSERT INTO transitions (job_id, state, reason, at) VALUES (?, 'queued', ?, ?)",
                (job_id, "submitted", now),
            )
            row = c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return JobRecord.from_row(row), True

    def _jobs(self, sql: str, params: Sequence[Any] = ()) -> list[JobRecord]:
        try:
            rows = self._reader().execute(sql, params).fetchall()
        except sqlite3.OperationalError as e:
            raise self._unavailable(e) from e
        return [JobRecord.from_row(r) for r in rows]

    def get_job(self, job_id: str) -> JobRecord | None:
        """Return the job, or None."""
        rows = self._jobs("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def list_jobs(
        self,
        *,
        states: Iterable[str] | None,
        before_seq: int | None,
        limit: int,
        user: str | None = None,
    ) -> list[JobRecord]:
        """Return up to ``limit`` jobs, newest first, optionally only those in ``states``
        and only those of ``user``."""
        sql = "SELECT * FROM jobs WHERE 1=1"
        params: list[Any] = []
        state_list = list(states or [])
        if state_list:
            sql += f" AND state IN ({','.join('?' * len(state_list))})"
            params.extend(state_list)
        if user is not None:
            sql += " AND user = ?"
            params.append(user)
        if before_seq is not None:
            sql += " AND seq < ?"
            params.append(before_seq)
        sql += " ORDER BY seq DESC LIMIT ?"
        params.append(limit)
        return self._jobs(sql, params)

    def job_by_key(self, user: str | None, idempotency_key: str) -> JobRecord | None:
        """The job ``user`` bound to ``idempotency_key``, if any."""
        rows = self._jobs(
            "SELECT * FROM jobs WHERE idempotency_key = ? AND COALESCE(user, '') = ?",
            [idempotency_key, user or ""],
        )
        return rows[0] if rows else None

    def queued_count(self, user: str | None) -> int:
        """How many jobs of ``user`` wait in the queue."""
        rows = self._query(
            "SELECT COUNT(*) AS n FROM jobs WHERE state = 'queued' AND COALESCE(user, '') = ?",
            [user or ""],
        )
        return int(rows[0]["n"])

    def jobs_in_states(self, states: Iterable[str]) -> list[JobRecord]:
        """Return all jobs in the given states in queue order: higher priority first, then
        in the order they were last queued (submitted, or resumed), oldest first."""
        state_list = list(states)
        return self._jobs(
            f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(state_list))})"
            " ORDER BY priority DESC, queue_seq, seq",
            state_list,
        )

    def users(self) -> list[str]:
        """The names of the users that have jobs, sorted."""
        rows = self._query("SELECT DISTINCT user FROM jobs WHERE user IS NOT NULL ORDER BY user")
        return [r["user"] for r in rows]

    def counts_by_state(self) -> dict[str, int]:
        """Return the number of jobs in each state that has any."""
        rows = self._query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        return {r["state"]: int(r["n"]) for r in rows}

    def transition(
        self,
        job_id: str,
        state: str,
        reason: str,
        *,
        from_states: Iterable[str] | None = None,
        **fields: Any,
    ) -> bool:
        """Move a job to ``state`` with a reason, setting extra columns in the same step.

        Terminal states are final: nothing happens (False) when the job is in one, or when
        ``from_states`` is given and the job is in none of them.
        """
        now = time.time()
        with self._tx(jobs_changed=True) as c:
            row = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["state"] in TERMINAL_STATES:
                return False
            if from_states is not None and row["state"] not in set(from_states):
                return False
            cols = {"state": state, "reason": reason, **fields}
            if state in TERMINAL_STATES:
                cols.setdefault("finished_at", now)
            if state == "starting":
                cols.setdefault("started_at", now)
            assignments = ", ".join(f"{k} = ?" for k in cols)
            c.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*cols.values(), job_id))
            c.execute(
                "INSERT INTO transitions (job_id, state, reason, at) VALUES (?, ?, ?, ?)",
                (job_id, state, reason, now),
            )
            return True

    def update_job(self, job_id: str, **fields: Any) -> None:
        """Set columns of a job without a state change."""
        if not fields:
            return
        assignments = ", ".join(f"{k} = ?" for k in fields)
        with self._tx(jobs_changed=True) as c:
            c.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*fields.values(), job_id))

    def request_cancel(self, job_id: str) -> JobRecord | None:
        """Mark a job as cancel-requested (first request wins) and return it."""
        with self._tx(jobs_changed=True) as c:
            c.execute(
                "UPDATE jobs SET cancel_requested_at = ? WHERE id = ?"
                " AND cancel_requested_at IS NULL",
                (time.time(), job_id),
            )
            row = c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return JobRecord.from_row(row) if row else None

    def delete_job(self, job_id: str) -> bool:
        """Delete a finished job and everything stored about it; False if not finished."""
        with self._tx(jobs_changed=True) as c:
            row = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["state"] not in TERMINAL_STATES:
                return False
            c.execute("DELETE FROM metrics WHERE job = ?", (_seq(c, job_id),))
            for table in ("summaries", "offsets", "transitions", "attempts", "events"):
                c.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            c.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return True

    def reopen(self, job_id: str, reason: str, *, spec: str) -> JobRecord | None:
        """Queue a finished job again (``POST /v1/jobs/{id}/resume``), in one transaction.

        Stores ``spec``, clears what belonged to the previous run (exit code, failure,
        cancel request, processes) and records the transition. Returns the new row, or None
        when the job is not (or no longer) finished.
        """
        now = time.time()
        with self._tx(jobs_changed=True) as c:
            row = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["state"] not in TERMINAL_STATES:
                return None
            c.execute(
                "UPDATE jobs SET state = 'queued', reason = ?, spec = ?, finished_at = NULL,"
                " exit_code = NULL, failure = NULL, cancel_requested_at = NULL, pid = NULL,"
                " pgid = NULL, create_time = NULL, recipe_summary = NULL, slurm_job_id = NULL,"
                " gpus = NULL, queue_seq = ? WHERE id = ?",
                (reason, spec, _next_queue_seq(c), job_id),
            )
            c.execute(
                "INSERT INTO transitions (job_id, state, reason, at) VALUES (?, 'queued', ?, ?)",
                (job_id, reason, now),
            )
            return JobRecord.from_row(
                c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            )

    # ------------------------------------------------------------------------- attempts

    def start_attempt(self, job_id: str, cause: str, resumed_from_step: int | None) -> int:
        """Record a new attempt of a job and return its number (1, 2, ...).

        The metric points after ``resumed_from_step`` (all of them when None) are dropped in
        the same transaction: the attempt trains those steps again and its points replace
        them.
        """
        now = time.time()
        with self._tx() as c:
            last = c.execute(
                "SELECT MAX(number) FROM attempts WHERE job_id = ?", (job_id,)
            ).fetchone()[0]
            number = int(last or 0) + 1
            c.execute(
                "INSERT INTO attempts (job_id, number, cause, resumed_from_step, started_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (job_id, number, cause, resumed_from_step, now),
            )
            keep = -1 if resumed_from_step is None else resumed_from_step
            dropped = c.execute(
                "DELETE FROM metrics WHERE job = ? AND step > ?", (_seq(c, job_id), keep)
            ).rowcount
            if dropped:
                summary = self._summary_from_points(c, job_id)
                summary.rejected_lines = self._read_summary(c, job_id).rejected_lines
                self._write_summary(c, job_id, summary)
            return number

    def finish_attempt(self, job_id: str, number: int, exit_code: int | None, reason: str) -> None:
        """Record how attempt ``number`` of a job ended (first record wins)."""
        with self._tx() as c:
            c.execute(
                "UPDATE attempts SET finished_at = ?, exit_code = ?, reason = ?"
                " WHERE job_id = ? AND number = ? AND finished_at IS NULL",
                (time.time(), exit_code, reason, job_id, number),
            )

    def set_attempt_slurm_job(self, job_id: str, number: int, slurm_job_id: str) -> None:
        """Record the Slurm job id of attempt ``number``, and on the job as its latest."""
        with self._tx(jobs_changed=True) as c:
            c.execute(
                "UPDATE attempts SET slurm_job_id = ? WHERE job_id = ? AND number = ?",
                (slurm_job_id, job_id, number),
            )
            c.execute("UPDATE jobs SET slurm_job_id = ? WHERE id = ?", (slurm_job_id, job_id))

    def attempts(self, job_id: str) -> list[AttemptRecord]:
        """Return a job's attempts, oldest first."""
        rows = self._query("SELECT * FROM attempts WHERE job_id = ? ORDER BY number", (job_id,))
        return [AttemptRecord.from_row(r) for r in rows]

    def current_attempt(self, job_id: str) -> int:
        """The number of a job's latest attempt (1 for a job launched before attempts were
        recorded, or not launched yet)."""
        rows = self._query("SELECT MAX(number) AS n FROM attempts WHERE job_id = ?", (job_id,))
        return int(rows[0]["n"] or 1)

    def history(self, job_id: str) -> list[dict[str, Any]]:
        """Return a job's transitions, oldest first (with their ``id``)."""
        return self._query(
            "SELECT id, state, reason, at FROM transitions WHERE job_id = ? ORDER BY id", (job_id,)
        )

    def transitions_after(self, job_id: str, after_id: int) -> list[dict[str, Any]]:
        """Return a job's transitions with ``id > after_id``."""
        return self._query(
            "SELECT id, state, reason, at FROM transitions WHERE job_id = ? AND id > ? ORDER BY id",
            (job_id, after_id),
        )

    def events(self, job_id: str, after_id: int = 0) -> list[dict[str, Any]]:
        """Return a job's recipe events with ``id > after_id``, oldest first."""
        return self._query(
            "SELECT id, attempt, kind, level, message, step, at FROM events"
            " WHERE job_id = ? AND id > ? ORDER BY id",
            (job_id, after_id),
        )

    # -------------------------------------------------------------------------- metrics

    def get_offset(self, job_id: str, stream: str) -> int:
        """Return how many bytes of a job's file were consumed (0 at first)."""
        rows = self._query(
            "SELECT byte_offset FROM offsets WHERE job_id = ? AND stream = ?", (job_id, stream)
        )
        return int(rows[0]["byte_offset"]) if rows else 0

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
            seq = _seq(c, job_id)
            if seq is None:  # deleted meanwhile
                return 0
            summary = self._read_summary(c, job_id)
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
                summary = self._summary_from_points(c, job_id)
            summary.rejected_lines += rejected
            if points or rejected or not exact:
                self._write_summary(c, job_id, summary)
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

    @staticmethod
    def _read_summary(c: sqlite3.Connection, job_id: str) -> MetricSummary:
        row = c.execute(
            f"SELECT {', '.join(_SUMMARY_COLUMNS)} FROM summaries WHERE job_id = ?", (job_id,)
        ).fetchone()
        return MetricSummary(*row) if row is not None else MetricSummary()

    @staticmethod
    def _write_summary(c: sqlite3.Connection, job_id: str, summary: MetricSummary) -> None:
        cols = ", ".join(_SUMMARY_COLUMNS)
        marks = ", ".join("?" * len(_SUMMARY_COLUMNS))
        c.execute(
            f"INSERT OR REPLACE INTO summaries (job_id, {cols}) VALUES (?, {marks})",
            (job_id, *astuple(summary)),
        )

    @staticmethod
    def _summary_from_points(c: sqlite3.Connection, job_id: str) -> MetricSummary:
        """The summary of a job computed from all its stored points (a scan: used when
        points are dropped, and when an old database is migrated)."""
        summary = MetricSummary()
        for row in c.execute(
            "SELECT step, data, received_at FROM metrics WHERE job = ? ORDER BY step",
            (_seq(c, job_id),),
        ):
            summary.add(row["step"], json.loads(row["data"]), row["received_at"], new=True)
        return summary

    def metric_summary(self, job_id: str) -> MetricSummary:
        """What the views show of a job's points (one row, whatever their number)."""
        return self._read_summary(self._reader(), job_id)

    def metrics_after(self, job_id: str, after_step: int, limit: int) -> list[dict[str, Any]]:
        """Return up to ``limit`` points with ``step > after_step`` in step order."""
        rows = self._query(
            "SELECT m.step, m.data, m.received_at FROM metrics m JOIN jobs j ON m.job = j.seq"
            " WHERE j.id = ? AND m.step > ?"
            " ORDER BY m.step LIMIT ?",
            (job_id, after_step, limit),
        )
        return rows
