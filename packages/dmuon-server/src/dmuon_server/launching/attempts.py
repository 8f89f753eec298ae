"""Attempts of a job, for every launcher: starting one and concluding one.

An attempt is one launch of a job's processes (the first, a restart after a rank died, or
a resume). Starting one records it (dropping the stored points after the checkpoint it
resumes from), writes the spec into the job's folder and clears the previous exit report,
and gives the command and environment to launch. Concluding one reads what the attempt
left (its exit report, the launcher's view) and decides how the job ends, the same way
whichever launcher ran it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmuon_server.config import EXIT_FILE, Settings
from dmuon_server.launching.command import attempt_argv, job_env, launch_env
from dmuon_server.launching.identity import Account, JobIdentities, account_env, chown_to, job_home
from dmuon_server.schemas import spec_of
from dmuon_server.storage.jobfiles import (
    CHECKPOINT_DIR,
    LOG_FILE,
    SPEC_FILE,
    CheckpointInfo,
    describe_failure,
    latest_checkpoint,
    metrics_file,
    restartable,
    trained_to_the_end,
)
from dmuon_server.storage.paths import PublicPaths
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.safefiles import open_in
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import MetricsTailer, metrics_stream

#: How a launcher changes a job's state (:func:`dmuon_server.scheduling.lifecycle.move_job` bound to
#: the store and hub): ``move(job_id, state, reason, from_states=..., **columns)``.
Move = Callable[..., bool]


@dataclass(frozen=True)
class AttemptStart:
    """An attempt recorded and ready to launch."""

    number: int
    argv: list[str]
    env: dict[str, str]
    resumed_from: CheckpointInfo | None
    #: The account the attempt runs as (None: the server's own).
    account: Account | None = None


def next_cause(store: Store, job: JobRecord) -> str:
    """The cause of a queued job's next attempt: ``submitted`` or ``resume``."""
    return "resume" if store.attempts(job.id) else "submitted"


def begin(
    settings: Settings,
    store: Store,
    job: JobRecord,
    cause: str,
    gpus: list[int],
    identities: JobIdentities,
) -> AttemptStart:
    """Record a new attempt of ``job`` and prepare its folder, owned by the account the job
    runs as (``identities``); return what to launch.

    Raises :class:`OSError` when the job's folder cannot be written and
    :class:`~dmuon_server.launching.identity.IdentityError` when the job's account is unusable (the
    attempt is then recorded; conclude it with :func:`fail_to_start`).
    """
    job_dir = settings.job_dir(job.id)
    spec = spec_of(job)
    latest = latest_checkpoint(job_dir / CHECKPOINT_DIR, recipe=spec.train is not None)
    number = store.start_attempt(job.id, cause, latest.step if latest is not None else None)
    argv = attempt_argv(spec, job.argv_list, job_dir, number, resuming=latest is not None)
    plan_env = launch_env(
        settings,
        spec,
        job_dir,
        attempt=number,
        gpus=gpus,
        resume_from=latest.path if latest is not None else None,
    )
    account = identities.account_for(job.user or "")
    home = job_home(account, job_dir, sandboxed=settings.sandbox == "bwrap")
    env = job_env(settings, {**plan_env, **account_env(account, home)})
    identities.prepare_job_dir(job_dir, account)
    write_job_file(job_dir, SPEC_FILE, job.spec.encode(), account)
    (job_dir / EXIT_FILE).unlink(missing_ok=True)  # the previous attempt's report
    return AttemptStart(number, argv, env, latest, account)


def write_job_file(job_dir: Path, name: str, data: bytes, account: Account | None) -> None:
    """Write the file ``name`` of a job's folder, owned by the job's ``account``, never
    through a link the job put in its place."""
    (job_dir / name).unlink(missing_ok=True)
    fd = open_in(job_dir, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "wb") as f:
        chown_to(f.fileno(), account)
        f.write(data)


def open_job_log(job_dir: Path, account: Account | None) -> int:
    """A descriptor appending to the job's log (created owned by ``account``), opened
    without following a link the job put in its place."""
    fd = open_in(job_dir, LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    chown_to(fd, account)
    return fd


def fail_to_start(
    store: Store,
    move: Move,
    job_id: str,
    number: int,
    why: str,
    from_states: Iterable[JobState],
) -> None:
    """Conclude an attempt that could not be launched: the job fails with ``why``."""
    store.finish_attempt(job_id, number, None, why)
    move(job_id, JobState.FAILED, why, from_states=list(from_states))


def final_poll(settings: Settings, tailer: MetricsTailer, job: JobRecord, number: int) -> None:
    """Read the rest of the attempt's metrics file, its last line too."""
    path = settings.job_dir(job.id) / metrics_file(number)
    tailer.poll(job.id, path, final=True, stream=metrics_stream(number), attempt=number)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the job records it.

    Attributes:
        state: ``succeeded``, ``failed`` or ``cancelled``.
        reason: The transition's reason.
        exit_code: The exit code to record (of the failing rank; negative: a signal).
        failure: The API's ``failure`` fields for a failed job.
        retry: Whether a failed attempt is worth relaunching (``max_restarts``).
    """

    state: JobState
    reason: str
    exit_code: int | None
    failure: dict[str, Any] | None = None
    retry: bool = False


@dataclass(frozen=True)
class SchedulerEnd:
    """What a cluster scheduler said about a finished attempt (Slurm): the service state
    it maps to and its reason."""

    state: JobState
    reason: str


def conclude(
    settings: Settings,
    job: JobRecord,
    report: dict[str, Any] | None,
    launcher_rc: int | None,
    scheduler: SchedulerEnd | None = None,
    *,
    disk_full: bool = False,
) -> Outcome:
    """How the attempt that left ``report`` (the runner's exit report, or None) ended.

    ``job`` is read after the attempt ended (its cancel request included); ``launcher_rc``
    is the launcher's exit status when known; ``scheduler`` is a cluster's own verdict;
    ``disk_full`` says the data directory's disk had no room left (the failure's reason
    names it, and the attempt is not retried: a rerun would meet the same full disk).

    A job that saved the checkpoint of its last step succeeded, whatever stopped it after
    (a cancel during its final evaluation); a job whose cancel was requested is cancelled,
    with exit code -9 when it had to be killed after the grace period and nothing else
    reported its status.
    """
    job_dir = settings.job_dir(job.id)
    rc = report.get("returncode") if report else launcher_rc
    cancelled_at = job.cancel_requested_at
    spec = spec_of(job)
    steps = spec.steps
    recipe = spec.train is not None
    if (
        cancelled_at is not None
        and steps is not None
        and trained_to_the_end(job_dir, steps, recipe=recipe)
    ):
        reason = f"trained all {steps} steps and saved the last checkpoint; the cancel came after"
        if scheduler is not None:
            reason += f" ({scheduler.reason})"
        return Outcome(JobState.SUCCEEDED, reason, rc)
    if scheduler is not None:
        state, reason = scheduler.state, scheduler.reason
    elif cancelled_at is not None:
        state, reason = JobState.CANCELLED, "cancelled on request"
    elif report and rc == 0:
        state, reason = JobState.SUCCEEDED, "torchrun exited with code 0"
    else:
        state, reason = JobState.FAILED, ""
    killed = cancelled_at is not None and time.time() >= cancelled_at + settings.cancel_grace_s
    if state == JobState.CANCELLED and rc is None and killed:
        # Killed after the grace period (by this server or the one before it, which is
        # then nobody's parent to learn the status).
        rc = -signal.SIGKILL
        reason += "; SIGKILL after the grace period"
    if state != JobState.FAILED:
        return Outcome(state, reason, rc)
    failure = describe_failure(
        job_dir, report, launcher_rc, settings.log_tail_lines, disk_full=disk_full
    )
    public = PublicPaths(settings, job_dir)
    failure["log_tail"] = [public.text(line) for line in failure["log_tail"]]
    if failure["message"]:
        failure["message"] = public.text(failure["message"])
    detail = public.text(failure.pop("reason"))
    if scheduler is None:
        reason = detail
    elif report is not None or disk_full:  # the runner knows which rank failed and why,
        reason = f"{reason}: {detail}"  # or the full disk is why it could not say
    retry = restartable(report, launcher_rc) and not disk_full
    return Outcome(JobState.FAILED, reason, failure["exit_code"], failure, retry)


def record(
    store: Store,
    move: Move,
    job_id: str,
    number: int,
    outcome: Outcome,
    from_states: Iterable[JobState],
) -> bool:
    """Record the end of attempt ``number`` and the job's final state; whether it moved."""
    store.finish_attempt(job_id, number, outcome.exit_code, outcome.reason)
    return move(
        job_id,
        outcome.state,
        outcome.reason,
        from_states=list(from_states),
        exit_code=outcome.exit_code,
        failure=json.dumps(outcome.failure) if outcome.failure else None,
    )


def restarts_used(store: Store, job_id: str) -> int:
    """Restarts since the job's last submission or resume."""
    used = 0
    for a in reversed(store.attempts(job_id)):
        if a.cause != "restart":
            break
        used += 1
    return used


def resume_point(settings: Settings, job: JobRecord) -> CheckpointInfo | None:
    """The checkpoint a new attempt of the job would resume from, or None."""
    recipe = spec_of(job).train is not None
    return latest_checkpoint(settings.job_dir(job.id) / CHECKPOINT_DIR, recipe=recipe)
