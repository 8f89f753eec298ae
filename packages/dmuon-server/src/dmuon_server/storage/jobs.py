"""The jobs table and its transitions: creating, listing, moving, reopening, deleting."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from typing import Any

from dmuon_server.storage.database import Database
from dmuon_server.storage.records import JobRecord, TransitionRecord
from dmuon_server.storage.schema import job_seq, next_queue_seq
from dmuon_server.storage.states import TERMINAL_STATES, JobState, check_transition


class IdempotencyConflict(Exception):
    """The idempotency key is already bound to a job with a different spec."""

    def __init__(self, job_id: str) -> None:
        """Remember the job the key belongs to."""
        super().__init__(job_id)
        self.job_id = job_id


class JobsTable(Database):
    """Jobs and their state transitions."""

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
                    next_queue_seq(c),
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
        states: Iterable[JobState] | None,
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

    def jobs_in_states(self, states: Iterable[JobState]) -> list[JobRecord]:
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

    def counts_by_state(self) -> dict[JobState, int]:
        """Return the number of jobs in each state that has any."""
        rows = self._query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")
        return {JobState(r["state"]): int(r["n"]) for r in rows}

    def transition(
        self,
        job_id: str,
        state: JobState,
        reason: str,
        *,
        from_states: Iterable[JobState] | None = None,
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
            check_transition(row["state"], state)
            cols = {"state": state, "reason": reason, **fields}
            if state in TERMINAL_STATES:
                cols.setdefault("finished_at", now)
            if state == JobState.STARTING:
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
            c.execute("DELETE FROM metrics WHERE job = ?", (job_seq(c, job_id),))
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
            check_transition(row["state"], JobState.QUEUED)
            c.execute(
                "UPDATE jobs SET state = 'queued', reason = ?, spec = ?, finished_at = NULL,"
                " exit_code = NULL, failure = NULL, cancel_requested_at = NULL, pid = NULL,"
                " pgid = NULL, create_time = NULL, recipe_summary = NULL, slurm_job_id = NULL,"
                " gpus = NULL, queue_seq = ? WHERE id = ?",
                (reason, spec, next_queue_seq(c), job_id),
            )
            c.execute(
                "INSERT INTO transitions (job_id, state, reason, at) VALUES (?, 'queued', ?, ?)",
                (job_id, reason, now),
            )
            return JobRecord.from_row(
                c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            )

    def history(self, job_id: str) -> list[TransitionRecord]:
        """A job's transitions, oldest first."""
        return self.transitions_after(job_id, 0)

    def transitions_after(self, job_id: str, after_id: int) -> list[TransitionRecord]:
        """A job's transitions with ``id > after_id``, oldest first."""
        rows = self._query(
            "SELECT id, state, reason, at FROM transitions WHERE job_id = ? AND id > ? ORDER BY id",
            (job_id, after_id),
        )
        return [TransitionRecord.from_row(r) for r in rows]
