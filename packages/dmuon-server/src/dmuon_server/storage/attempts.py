"""The attempts of a job: each run of it, with its cause and its end."""

from __future__ import annotations

import time

from dmuon_server.storage.database import Database
from dmuon_server.storage.records import AttemptRecord
from dmuon_server.storage.schema import job_seq
from dmuon_server.storage.summary import read_summary, summary_from_points, write_summary


class AttemptsTable(Database):
    """A job's attempts."""

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
                "DELETE FROM metrics WHERE job = ? AND step > ?", (job_seq(c, job_id), keep)
            ).rowcount
            if dropped:
                summary = summary_from_points(c, job_id)
                summary.rejected_lines = read_summary(c, job_id).rejected_lines
                write_summary(c, job_id, summary)
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
