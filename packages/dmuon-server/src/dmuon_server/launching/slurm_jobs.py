"""Running jobs under Slurm: submit, follow, cancel, re-attach.

The supervisor schedules over :class:`SlurmLauncher` when the server runs with
``--launcher slurm``. A job waits in the service's queue until it is submitted (at once:
Slurm schedules, the service adds no limit of its own); from then on its Slurm job id
(stored on the job and on the attempt) is all the server needs to follow it, also after a
restart. States follow :func:`dmuon_server.launching.slurm.service_state`; attempts start
and end as :mod:`dmuon_server.launching.attempts` says, as on the local host.

Cancellation: SIGTERM to the job's steps (``scancel --signal=TERM``), which reaches the
ranks (they finish the step, save a checkpoint and exit) while the runner around torchrun
lets it pass; after the server's cancel grace period a plain ``scancel`` ends what is left.

A full data directory: as on the local host, a job's end is still seen while its points
cannot be stored, and the server gives back its reserve to record the end
(:mod:`dmuon_server.launching.full_disk`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from dmuon_server.config import Settings
from dmuon_server.launching import attempts
from dmuon_server.launching.attempts import Move, SchedulerEnd, write_job_file
from dmuon_server.launching.command import program_of
from dmuon_server.launching.enforcement import LimitStatus
from dmuon_server.launching.full_disk import FullDisk
from dmuon_server.launching.identity import Account, IdentityError, JobIdentities
from dmuon_server.launching.protocol import Isolated
from dmuon_server.launching.slurm import (
    BatchOptions,
    SlurmClient,
    SlurmError,
    SlurmJob,
    batch_script,
    is_final,
    service_state,
)
from dmuon_server.schemas import JobCreate, spec_of
from dmuon_server.storage.datadir import StartupError
from dmuon_server.storage.jobfiles import LOG_FILE, TORCHRUN_LOG_DIR, metrics_file, read_exit_report
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import Hub, MetricsTailer, metrics_stream
from dmuon_server.users import Users

log = logging.getLogger("dmuon_server.slurm")

#: Service states of a job Slurm may hold (``queued`` once it has a Slurm job id).
SLURM_HELD_STATES = (JobState.QUEUED, JobState.STARTING, JobState.RUNNING)
#: torchrun's signals other than SIGTERM, which the ranks get from Slurm directly.
_TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def job_name(job_id: str) -> str:
    """Slurm's name for a job of this service."""
    return f"dmuon-{job_id}"


def write_batch_script(
    settings: Settings,
    spec: JobCreate,
    job_dir: Path,
    attempt: int,
    recipe: list[str],
    account: Account | None = None,
) -> Path:
    """Write attempt ``attempt``'s sbatch script into the job's folder (owned by the job's
    ``account``) and return its path.

    ``recipe`` is the program torchrun runs: ``-m MODULE FLAGS...`` or a script and its
    arguments.
    """
    opts = BatchOptions(
        job_name=job_name(job_dir.name),
        nnodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        partition=spec.partition,
        time_limit=spec.time_limit,
        account=spec.account,
        gpus_per_node=spec.gpus_per_node or 0,
    )
    text = batch_script(
        opts,
        python=settings.python,
        job_dir=job_dir,
        log_file=job_dir / LOG_FILE,
        torchrun_opts=[
            f"--signals-to-handle={_TORCHRUN_SIGNALS}",
            "--tee",
            "3",
            "--log-dir",
            str(job_dir / TORCHRUN_LOG_DIR),
        ],
        recipe=recipe,
        runner_flags=["--ignore-sigterm"],
    )
    name = f"slurm-attempt-{attempt}.sh"
    write_job_file(job_dir, name, text.encode(), account)
    return job_dir / name


def check_slurm(settings: Settings) -> None:
    """Check that the Slurm launcher can work: Slurm's commands are on PATH.

    The data directory (checked writable by the caller) must also be mounted at the same
    path on every node; the server cannot see the nodes, so the documentation states it.
    """
    missing = SlurmClient().missing_commands()
    if missing:
        raise StartupError(
            f"--launcher slurm needs Slurm's commands on PATH; not found: {', '.join(missing)}. "
            "Install the Slurm client tools (and point them at the cluster's slurm.conf), "
            "or run with --launcher local"
        )


class SlurmLauncher:
    """Jobs on a Slurm cluster (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        hub: Hub,
        tailer: MetricsTailer,
        move: Move,
        identities: JobIdentities | None = None,
        client: SlurmClient | None = None,
    ) -> None:
        """Work on ``store`` with ``move`` (the state change that wakes the streams),
        submitting as the accounts ``identities`` say."""
        self.settings = settings
        self.identities = identities or JobIdentities(settings, Users(None))
        self.store = store
        self.hub = hub
        self.tailer = tailer
        self._move = move
        self.client = client or SlurmClient()
        self.capacity: int | None = None
        self.launched_total = 0
        self.limit_statuses: tuple[LimitStatus, ...] = ()  # Slurm holds its own
        self._cancel_deadline: dict[str, float] = {}
        #: Jobs stopped for a limit of the server's (their metrics), with the cause.
        self._stopped_by: dict[str, str] = {}
        self._next_query: dict[str, float] = {}
        self.full_disk = FullDisk(settings)

    # ------------------------------------------------------------------ recovery

    def recover(self) -> None:
        """Re-attach to the jobs of a previous server.

        Jobs are followed by their stored Slurm job id: the first :meth:`tick` asks Slurm
        about them (a job that ended meanwhile gets its final state from ``sacct``). A
        job whose submission the previous server started but did not record is found by
        its Slurm job name, so that it is not submitted twice. Cancel deadlines are
        restored.
        """
        for job in self.store.jobs_in_states(SLURM_HELD_STATES):
            if job.slurm_job_id is None:
                self._adopt(job)
                continue
            log.info("job %s: re-attached to Slurm job %s", job.id, job.slurm_job_id)
            if job.cancel_requested_at is not None:
                self._cancel_deadline[job.id] = (
                    job.cancel_requested_at + self.settings.cancel_grace_s
                )

    def _adopt(self, job: JobRecord) -> None:
        history = self.store.attempts(job.id)
        if not history or history[-1].finished_at is not None:
            return  # waiting in the service's queue, never submitted
        number = history[-1].number
        try:
            found = self.client.find_by_name(job_name(job.id))
        except SlurmError as e:
            log.warning("job %s: %s", job.id, e)
            found = []
        if found:
            self.store.set_attempt_slurm_job(job.id, number, found[-1])
            log.info("job %s: adopted Slurm job %s", job.id, found[-1])
        else:
            why = "the server stopped before the attempt was submitted"
            self.store.finish_attempt(job.id, number, None, why)

    # --------------------------------------------------------------------- start

    def waiting(self, job: JobRecord) -> bool:
        """A queued job waits in the service's queue until it has a Slurm job id."""
        return job.slurm_job_id is None

    def start(self, job: JobRecord, gpus: list[int]) -> None:
        """Submit the next attempt of a queued job with ``sbatch`` (Slurm picks the GPUs:
        ``gpus`` is empty)."""
        job_id = job.id
        job_dir = self.settings.job_dir(job_id)
        number = None
        try:
            start = attempts.begin(
                self.settings,
                self.store,
                job,
                attempts.next_cause(self.store, job),
                [],
                self.identities,
            )
            number = start.number
            script = write_batch_script(
                self.settings,
                spec_of(job),
                job_dir,
                number,
                program_of(start.argv),
                start.account,
            )
            slurm_id = self.client.submit(script, start.env, start.account)
        except (OSError, SlurmError, IdentityError) as e:
            why = f"could not submit the job to Slurm: {e}"
            if number is None:
                number = self.store.current_attempt(job_id)
            attempts.fail_to_start(self.store, self._move, job_id, number, why, [JobState.QUEUED])
            return
        self.store.set_attempt_slurm_job(job_id, number, slurm_id)
        self.launched_total += 1
        self._move(
            job_id,
            JobState.QUEUED,
            f"submitted to Slurm as job {slurm_id}",
            from_states=[JobState.QUEUED],
            pid=None,
            pgid=None,
            create_time=None,
        )
        log.info("job %s: attempt %d submitted as Slurm job %s", job_id, number, slurm_id)

    # ---------------------------------------------------------------------- tick

    def tick(self, isolated: Isolated) -> None:
        """Follow every submitted job once, each inside ``isolated(job_id)``."""
        self.full_disk.replenish()
        for job in self.store.jobs_in_states(SLURM_HELD_STATES):
            if job.slurm_job_id is not None:
                with isolated(job.id):
                    self._follow(job)

    def _follow(self, job: JobRecord) -> None:
        job_id = job.id
        slurm_id = job.slurm_job_id
        assert slurm_id is not None
        attempt = self.store.current_attempt(job_id)
        path = self.settings.job_dir(job_id) / metrics_file(attempt)
        self.full_disk.poll(
            job_id,
            lambda: self.tailer.poll(job_id, path, stream=metrics_stream(attempt), attempt=attempt),
        )
        over = self.tailer.over_limit.get(job_id)
        if over is not None and job_id not in self._stopped_by:
            self._stopped_by[job_id] = over  # past what its metrics may store
            self._cancel_deadline[job_id] = float("inf")
            self._scancel(slurm_id)
        deadline = self._cancel_deadline.get(job_id)
        if deadline is not None and time.time() >= deadline:
            log.warning("job %s: grace period over, scancel %s", job_id, slurm_id)
            self._cancel_deadline[job_id] = float("inf")
            self._scancel(slurm_id)
        now = time.monotonic()
        if now < self._next_query.get(job_id, 0.0):
            return
        self._next_query[job_id] = now + self.settings.slurm_poll_interval_s
        try:
            sj = self.client.query(slurm_id)
        except SlurmError as e:
            log.warning("job %s: %s", job_id, e)
            return
        if sj is None:
            sj = SlurmJob(slurm_id, "UNKNOWN", "Slurm has no record of the job any more")
        cancel = job.cancel_requested_at is not None
        mapped = service_state(sj, cancel_requested=cancel)
        if not is_final(sj):
            # A pending job shows each new Slurm reason (Priority, Resources, ...); a
            # running one changes only when it starts.
            if mapped.state != job.state or (
                mapped.state == JobState.QUEUED and mapped.reason != job.reason
            ):
                fields = {"started_at": time.time()} if mapped.state == JobState.RUNNING else {}
                self._move(job_id, mapped.state, mapped.reason, **fields)
            return
        self._finish(job, attempt, sj)

    def _finish(self, job: JobRecord, attempt: int, sj: SlurmJob) -> None:
        # Judged before anything is written: a full disk may be why the runner left no
        # report, and the reserve may go below.
        full = self.full_disk.full_at_end(job.id, self.settings.job_dir(job.id))
        self.full_disk.record(job.id, lambda: self._conclude(job, attempt, sj, full))
        self.full_disk.forget(job.id)

    def _conclude(self, job: JobRecord, attempt: int, sj: SlurmJob, full: bool) -> None:
        attempts.final_poll(self.settings, self.tailer, job, attempt)
        self._cancel_deadline.pop(job.id, None)
        self._next_query.pop(job.id, None)
        fresh = self.store.get_job(job.id) or job
        mapped = service_state(sj, cancel_requested=fresh.cancel_requested_at is not None)
        report = read_exit_report(self.settings.job_dir(job.id))
        end = SchedulerEnd(mapped.state, mapped.reason)
        outcome = attempts.conclude(self.settings, fresh, report, sj.exit_code, end, disk_full=full)
        stopped_by = self._stopped_by.pop(job.id, None)
        if stopped_by is not None:  # the server's limit is the cause: a failure, not retried
            failure = {**(outcome.failure or {}), "limit": stopped_by}
            outcome = dataclasses.replace(
                outcome, state=JobState.FAILED, reason=stopped_by, failure=failure, retry=False
            )
        if attempts.record(self.store, self._move, job.id, attempt, outcome, SLURM_HELD_STATES):
            log.info("job %s: %s (%s)", job.id, outcome.state, outcome.reason)
        self.tailer.forget(job.id)

    # -------------------------------------------------------------------- cancel

    def cancel(self, job: JobRecord) -> None:
        """Cancel a submitted job (the request is already recorded).

        A pending job is removed from Slurm's queue; a running one gets SIGTERM in its
        steps now and a plain ``scancel`` after the grace period.
        """
        job_id = job.id
        slurm_id = job.slurm_job_id
        if job_id in self._cancel_deadline or slurm_id is None:
            return
        if job.state == JobState.QUEUED:
            self._cancel_deadline[job_id] = float("inf")
            self._scancel(slurm_id)
        else:
            self._cancel_deadline[job_id] = time.time() + self.settings.cancel_grace_s
            try:
                self.client.signal_steps(slurm_id, "TERM")
            except SlurmError as e:
                log.warning("job %s: %s", job_id, e)
            log.info("job %s: SIGTERM to the steps of Slurm job %s", job_id, slurm_id)
        self._next_query.pop(job_id, None)
        self.hub.notify(job_id)

    def _scancel(self, slurm_id: str) -> None:
        try:
            self.client.cancel(slurm_id)
        except SlurmError as e:
            log.warning("%s", e)
