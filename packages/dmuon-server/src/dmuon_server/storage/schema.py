"""The database's tables and indexes, its version, and the small SQL helpers every table
uses."""

from __future__ import annotations

import sqlite3

#: Version 2: metric points in a rowid table (a point of 1 KB fits its page instead of
#: spilling into overflow pages), a summary row per job kept current at ingest; jobs with
#: their queue order apart from their creation order, their user (idempotency keys are per
#: user), priority and devices.
SCHEMA_VERSION = 2

#: Metric points: a rowid table, whose rows keep up to about 4 KB on their page (a
#: WITHOUT ROWID row above about 1 KB spills into overflow pages of its own), keyed by the
#: job's ``seq`` (a few bytes) rather than its 32-character id.
METRICS_TABLE = """
CREATE TABLE IF NOT EXISTS metrics (
    job INTEGER NOT NULL,
    step INTEGER NOT NULL,
    data TEXT NOT NULL,
    received_at REAL NOT NULL,
    PRIMARY KEY (job, step)
)"""

#: Jobs. An idempotency key is unique per user (index ``jobs_by_key``).
JOBS_TABLE = """
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
INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, priority, queue_seq);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_key ON jobs (COALESCE(user, ''), idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_by_user ON jobs (user, seq)
"""
#: The columns of a version-1 ``jobs`` table.
V1_JOB_COLUMNS = (
    "seq, id, name, state, nproc, spec, spec_hash, idempotency_key, created_at, started_at,"
    " finished_at, exit_code, reason, pid, pgid, create_time, cancel_requested_at, failure,"
    " recipe_summary, argv, slurm_job_id"
)

SCHEMA = (
    METRICS_TABLE
    + ";\n"
    + JOBS_TABLE
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
ADDED_COLUMNS = (("jobs", "slurm_job_id", "TEXT"), ("attempts", "slurm_job_id", "TEXT"))
#: The summary columns, in the order of :class:`MetricSummary`'s fields.
SUMMARY_COLUMNS = (
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


def job_seq(c: sqlite3.Connection, job_id: str) -> int | None:
    """The ``seq`` of a job (the key of its metric points), or None for an unknown job."""
    row = c.execute("SELECT seq FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return int(row[0]) if row else None


def next_queue_seq(c: sqlite3.Connection) -> int:
    """The queue position after every job queued so far (a job joins at the end)."""
    return int(c.execute("SELECT COALESCE(MAX(queue_seq), 0) + 1 FROM jobs").fetchone()[0])
