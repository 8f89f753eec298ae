"""Refuse to reopen a data directory whose running jobs another launcher started.

A server started with ``--launcher local`` cannot follow Slurm jobs, and one started with
``--launcher slurm`` cannot follow processes on its own host: either would mark those jobs
failed while they still run. The server refuses to start instead, naming the jobs.
"""

from __future__ import annotations

from dmuon_server.storage.datadir import StartupError
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store

#: The job states a launcher follows (a Slurm job waiting in Slurm's queue is ``queued``).
_ACTIVE_STATES = (JobState.QUEUED, JobState.STARTING, JobState.RUNNING)


def _started_by(job: JobRecord) -> str | None:
    if job.slurm_job_id is not None:
        return "slurm"
    if job.pid is not None:
        return "local"
    return None


def check_launcher_matches(store: Store, launcher: str) -> None:
    """Raise :class:`StartupError` when a job still active in ``store`` was started by a
    launcher other than ``launcher``; jobs still in the service's queue move freely."""
    foreign = [
        job
        for job in store.jobs_in_states(_ACTIVE_STATES)
        if _started_by(job) not in (None, launcher)
    ]
    if not foreign:
        return
    other = _started_by(foreign[0])
    ids = ", ".join(job.id for job in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
    raise StartupError(
        f"{len(foreign)} job(s) of this data directory were started with --launcher {other} "
        f"and may still run ({ids}); start the server with --launcher {other} to follow "
        f"them to the end, or cancel them first"
    )
