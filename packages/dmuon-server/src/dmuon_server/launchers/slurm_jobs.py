"""Supervising jobs that run under Slurm: submit, follow, cancel, re-attach.

The supervisor hands its work to :class:`SlurmJobs` when the server runs with
``--launcher slurm``. A job waits in the service's queue until it is submitted; from then
on Slurm schedules it, and its Slurm job id (stored on the job and on the attempt) is all
the server needs to follow it, also after a restart. States follow
:func:`dmuon_server.launchers.slurm.service_state`.

Cancellation: SIGTERM to the job's steps (``scancel --signal=TERM``), which reaches the
ranks (they finish the step, save a checkpoint and exit) while the runner around torchrun
lets it pass; after the server's cancel grace period a plain ``scancel`` ends what is left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from dmuon_server.config import Settings
from dmuon_server.datadir import StartupError
from dmuon_server.jobfiles import (
    CHECKPOINT_DIR,
    LOG_FILE,
    SPEC_FILE,
    TORCHRUN_LOG_DIR,
    describe_failure,
    latest_checkpoint,
    metrics_file,
    read_exit_report,
    trained_to_the_end,
)
from dmuon_server.launch import attempt_argv, job_env, launch_env
from dmuon_server.launchers.slurm import (
    BatchOptions,
    ServiceState,
    SlurmClient,
    SlurmError,
    SlurmJob,
    batch_script,
    is_final,
    service_state,
)
from dmuon_server.metrics import Hub, MetricsTailer, metrics_stream
from dmuon_server.paths import PublicPaths
from dmuon_server.runner import EXIT_FILE
from dmuon_server.schemas import JobCreate
from dmuon_server.store import Store

log = logging.getLogger("dmuon_server.slurm")

#: Service states of a job Slurm may hold (``queued`` once it has a Slurm job id).
SLURM_HELD_STATES = ("queued", "starting", "running")
#: torchrun's signals other than SIGTERM, which the ranks get from Slurm directly.
_TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def job_name(job_id: str) -> str:
    """Slurm's name for a job of this service."""
    return f"dmuon-{job_id}"


def split_recipe(runner_argv: list[str]) -> list[str]:
    """The ``-m MODULE FLAGS...`` part of a job's stored runner argv."""
    args = runner_argv[runner_argv.index("--") + 1 :]
    return args[args.index("-m") :]


def write_batch_script(
    settings: Settings, spec: JobCreate, job_dir: Path, attempt: int, recipe: list[str]
) -> Path:
    """Write attempt ``attempt``'s sbatch script into the job's folder and return its path."""
    opts = BatchOptions(
        job_name=job_name(job_dir.name),
        nnodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        partition=spec.partition,
        time_limit=spec.time_limit,
        account=spec.account,
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
    path = job_dir / f"slurm-attempt-{attempt}.sh"
    path.write_text(text)
    return path


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


class SlurmJobs:
    """The Slurm side of the supervisor; called under the supervisor's lock."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        hub: Hub,
        tailer: MetricsTailer,
        move: Callable[..., bool],
        client: SlurmClient | None = None,
        on_submitted: Callable[[], None] = lambda: None,
    ) -> None:
        """Work on ``store`` with ``move`` (the supervisor's state change); ``on_submitted``
        is called after each successful ``sbatch``."""
        self.settings = settings
        self.store = store
        self.hub = hub
        self.tailer = tailer
        self._move = move
        self.client = client or SlurmClient()
        self.on_submitted = on_submitted
        self._cancel_deadline: dict[str, float] = {}
        self._next_query: dict[str, float] = {}

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
            if job["slurm_job_id"] is None:
                self._adopt(job)
                continue
            log.info("job %s: re-attached to Slurm job %s", job["id"], job["slurm_job_id"])
            if job["cancel_requested_at"] is not None:
                self._cancel_deadline[job["id"]] = (
                    job["cancel_requested_at"] + self.settings.cancel_grace_s
                )

    def _adopt(self, job: dict[str, Any]) -> None:
        attempts = self.store.attempts(job["id"])
        if not attempts or attempts[-1]["finished_at"] is not None:
            return  # waiting in the service's queue, never submitted
        number = attempts[-1]["number"]
        try:
            found = self.client.find_by_name(job_name(job["id"]))
        except SlurmError as e:
            log.warning("job %s: %s", job["id"], e)
            found = []
        if found:
            self.store.set_attempt_slurm_job(job["id"], number, found[-1])
            log.info("job %s: adopted Slurm job %s", job["id"], found[-1])
        else:
            why = "the server stopped before the attempt was submitted"
            self.store.finish_attempt(job["id"], number, None, why)

    # ---------------------------------------------------------------------- tick

    def tick(
        self, isolated: Callable[[str], AbstractContextManager[None]] = lambda _: nullcontext()
    ) -> None:
        """Submit the jobs waiting in the service's queue, then follow submitted ones,
        each job's round inside ``isolated(job_id)`` (which may log and swallow its error)."""
        for job in self.store.jobs_in_states(SLURM_HELD_STATES):
            with isolated(job["id"]):
                if job["slurm_job_id"] is None:
                    if job["state"] == "queued":
                        self._submit(job)
                else:
                    self._follow(job)

    def _submit(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        spec = JobCreate.model_validate_json(job["spec"])
        cause = "resume" if self.store.attempts(job_id) else "submitted"
        latest = latest_checkpoint(job_dir / CHECKPOINT_DIR)
        attempt = self.store.start_attempt(
            job_id, cause, latest.step if latest is not None else None
        )
        argv = attempt_argv(
            json.loads(job["argv"]), job_dir, attempt, spec.train.steps, resuming=latest is not None
        )
        env = job_env(self.settings, launch_env(self.settings, job_id, spec.nproc_per_node))
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / SPEC_FILE).write_text(job["spec"])
            (job_dir / EXIT_FILE).unlink(missing_ok=True)
            script = write_batch_script(self.settings, spec, job_dir, attempt, split_recipe(argv))
            slurm_id = self.client.submit(script, env)
        except (OSError, SlurmError) as e:
            why = f"could not submit the job to Slurm: {e}"
            self.store.finish_attempt(job_id, attempt, None, why)
            self._move(job_id, "failed", why, from_states=["queued"])
            return
        self.store.set_attempt_slurm_job(job_id, attempt, slurm_id)
        self.on_submitted()
        self._move(
            job_id,
            "queued",
            f"submitted to Slurm as job {slurm_id}",
            from_states=["queued"],
            pid=None,
            pgid=None,
            create_time=None,
        )
        log.info("job %s: attempt %d submitted as Slurm job %s", job_id, attempt, slurm_id)

    def _follow(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        slurm_id = job["slurm_job_id"]
        attempt = self.store.current_attempt(job_id)
        path = self.settings.job_dir(job_id) / metrics_file(attempt)
        self.tailer.poll(job_id, path, stream=metrics_stream(attempt))
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
        cancel = job["cancel_requested_at"] is not None
        mapped = service_state(sj, cancel_requested=cancel)
        if not is_final(sj):
            # A pending job shows each new Slurm reason (Priority, Resources, ...); a
            # running one changes only when it starts.
            if mapped.state != job["state"] or (
                mapped.state == "queued" and mapped.reason != job["reason"]
            ):
                fields = {"started_at": time.time()} if mapped.state == "running" else {}
                self._move(job_id, mapped.state, mapped.reason, **fields)
            return
        self._finish(job, attempt, sj)

    def _finish(self, job: dict[str, Any], attempt: int, sj: SlurmJob) -> None:
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        self.tailer.poll(job_id, job_dir / metrics_file(attempt), final=True,
                         stream=metrics_stream(attempt))  # fmt: skip
        self._cancel_deadline.pop(job_id, None)
        self._next_query.pop(job_id, None)
        fresh = self.store.get_job(job_id) or job
        cancelled = fresh["cancel_requested_at"] is not None
        mapped = service_state(sj, cancel_requested=cancelled)
        steps = JobCreate.model_validate_json(fresh["spec"]).train.steps
        if cancelled and trained_to_the_end(job_dir, steps):
            mapped = ServiceState(
                "succeeded",
                f"trained all {steps} steps and saved the last checkpoint; the cancel came "
                f"after ({mapped.reason})",
            )
        report = read_exit_report(job_dir)
        rc = report.get("returncode") if report else sj.exit_code
        failure = None
        reason = mapped.reason
        if mapped.state == "failed":
            failure = describe_failure(job_dir, report, sj.exit_code, self.settings.log_tail_lines)
            public = PublicPaths(self.settings, job_dir)
            failure["log_tail"] = [public.text(line) for line in failure["log_tail"]]
            if failure["message"]:
                failure["message"] = public.text(failure["message"])
            detail = failure.pop("reason")
            if report is not None:  # the runner knows which rank failed and why
                reason = f"{reason}: {detail}"
            rc = failure["exit_code"]
        self.store.finish_attempt(job_id, attempt, rc, reason)
        if self._move(
            job_id,
            mapped.state,
            reason,
            from_states=SLURM_HELD_STATES,
            exit_code=rc,
            failure=json.dumps(failure) if failure else None,
        ):
            log.info("job %s: %s (%s)", job_id, mapped.state, reason)

    # -------------------------------------------------------------------- cancel

    def cancel(self, job: dict[str, Any]) -> None:
        """Cancel a job that has a Slurm job id (the request is already recorded).

        A pending job is removed from Slurm's queue; a running one gets SIGTERM in its
        steps now and a plain ``scancel`` after the grace period.
        """
        job_id = job["id"]
        slurm_id = job["slurm_job_id"]
        if job_id in self._cancel_deadline:
            return
        if job["state"] == "queued":
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
