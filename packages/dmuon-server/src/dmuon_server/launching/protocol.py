"""The interface every launcher offers the supervisor."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from dmuon_server.launching.enforcement import LimitStatus
from dmuon_server.storage.records import JobRecord

#: ``move(job_id, state, reason, from_states=..., **fields)``: the one way a launcher
#: changes a job's state (`dmuon_server.scheduling.lifecycle.move_job`); whether it changed.
Move = Callable[..., bool]

#: ``isolated(job_id)``: a context in which one job's round runs, so that its error is
#: logged and does not stop the round of the others.
Isolated = Callable[[str | None], AbstractContextManager[None]]


class Launcher(Protocol):
    """Runs jobs somewhere, and follows them there.

    The supervisor decides which queued job starts and when (priorities, GPUs, slots);
    a launcher starts it, watches it (metrics, its end, restarts), cancels it, and
    re-attaches to what a previous server left running. It is called under the
    supervisor's lock.
    """

    #: Jobs that may be active at once (None: the launcher's scheduler decides).
    capacity: int | None
    #: Attempts launched by this server process.
    launched_total: int

    @property
    def limit_statuses(self) -> tuple[LimitStatus, ...]:
        """The kernel limits the launcher holds for jobs, and those it cannot (empty where
        a scheduler such as Slurm holds its own); a reload of the users file may change
        them."""

    def recover(self) -> None:
        """Re-attach to the jobs a previous server launched."""

    def tick(self, isolated: Isolated) -> None:
        """Follow every launched job once: its metrics, its end, overdue cancels."""

    def waiting(self, job: JobRecord) -> bool:
        """Whether a queued job is still in the service's own queue (not launched)."""

    def start(self, job: JobRecord, gpus: list[int]) -> None:
        """Launch the next attempt of a queued job on ``gpus``."""

    def cancel(self, job: JobRecord) -> None:
        """Stop a launched job (its cancel request is recorded already)."""


#: Builds a launcher: ``(settings, store, hub, tailer, move, identities)``.
LauncherFactory = Callable[..., Launcher]
