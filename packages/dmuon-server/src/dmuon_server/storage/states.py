"""A job's states and the one table of the moves between them."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum


class JobState(str, Enum):
    """Where a job stands. Its value is what the API, the database and the logs show."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


#: States a job never leaves, except to be queued again on request (resume).
TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
)
#: States of a launched job (a process, or a Slurm job that runs).
ACTIVE_STATES: frozenset[JobState] = frozenset({JobState.STARTING, JobState.RUNNING})
#: Every state, in the order a job goes through them.
ALL_STATES: tuple[JobState, ...] = tuple(JobState)

#: Every move a job may make. A queued job moves to ``queued`` again when only its reason
#: changes (a Slurm job's pending reason) and straight to ``running`` under Slurm (which
#: starts it); a launched job goes back to ``starting`` for a restart, and a running Slurm
#: job back to ``queued`` when Slurm requeues it; a finished job is only queued again (a
#: resume), through `dmuon_server.storage.jobs.JobsTable.reopen`.
TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.QUEUED, JobState.STARTING, JobState.RUNNING})
    | TERMINAL_STATES,
    JobState.STARTING: frozenset({JobState.STARTING, JobState.RUNNING}) | TERMINAL_STATES,
    JobState.RUNNING: frozenset({JobState.QUEUED, JobState.STARTING}) | TERMINAL_STATES,
    **{end: frozenset({JobState.QUEUED}) for end in TERMINAL_STATES},
}


class IllegalTransition(ValueError):
    """A move the transition table does not allow: a bug in the caller, not a user error."""


def check_transition(current: JobState | str, new: JobState | str) -> None:
    """Raise :class:`IllegalTransition` unless a job in ``current`` may move to ``new``."""
    if JobState(new) not in TRANSITIONS[JobState(current)]:
        raise IllegalTransition(f"a {current} job cannot move to {new}")
