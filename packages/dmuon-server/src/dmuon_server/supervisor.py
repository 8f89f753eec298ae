"""Watching and cancelling jobs, and starting queued ones: the supervisor thread.

Every ``poll_interval_s`` the thread:

* tails each active job's metrics file into the store (``starting`` -> ``running`` once
  the first point is stored);
* notices jobs that ended (its own children are reaped with ``Popen.poll``; a job it
  re-attached to after a restart is recognised by pid *and* process create time), and
  records ``succeeded``/``failed``/``cancelled`` from the exit report, after a final
  read of the metrics file;
* escalates cancellations: SIGTERM to the job's ranks at once (the recipe finishes its
  step, saves a checkpoint and exits 0), SIGKILL to what is left after ``cancel_grace_s``;
* relaunches a job whose rank died, up to the spec's ``max_restarts`` times (see
  :func:`dmuon_server.jobfiles.restartable` for what is retried): each launch is an
  *attempt*, recorded in the store, with a metrics file of its own; ``--resume auto`` makes
  the recipe continue from the job's latest checkpoint, and the stored points after that
  checkpoint's step are dropped, so the new attempt's points replace them;
* starts queued jobs in FIFO order while fewer than ``max_concurrent_jobs`` are active.

Jobs run with stdout and stderr going to ``<job-dir>/job.log``, not to pipes, in a session
of their own, so they neither notice nor die when the server stops. How a job is launched
is :mod:`dmuon_server.launch`, how its processes are found :mod:`dmuon_server.procs`, and
what its files say :mod:`dmuon_server.jobfiles`.

With ``--launcher slurm`` the same thread hands every round, the recovery and the
cancellations to :class:`dmuon_server.launchers.slurm_jobs.SlurmJobs` instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil

from dmuon_server.config import Settings
from dmuon_server.jobfiles import (
    CHECKPOINT_DIR,
    LOG_FILE,
    SPEC_FILE,
    describe_failure,
    latest_checkpoint,
    metrics_file,
    read_exit_report,
    restartable,
    trained_to_the_end,
)
from dmuon_server.launch import attempt_argv, job_env, launch_env
from dmuon_server.launchers.slurm_jobs import SlurmJobs
from dmuon_server.lifecycle import move_job
from dmuon_server.metrics import Hub, MetricsTailer, metrics_stream
from dmuon_server.paths import PublicPaths
from dmuon_server.procs import (
    find_job_processes,
    find_runner,
    kill_and_reap,
    signal_job,
    signal_ranks,
    verified_process,
)
from dmuon_server.runner import EXIT_FILE
from dmuon_server.schemas import ACTIVE_STATES, JobCreate
from dmuon_server.store import Store

log = logging.getLogger("dmuon_server.supervisor")


class JobFinishing(Exception):
    """A cancel of a job that has trained all its steps and is finishing."""

    def __init__(self, job_id: str, steps: int) -> None:
        """Name the job and its steps."""
        super().__init__(job_id)
        self.job_id = job_id
        self.steps = steps


class Supervisor:
    """Owns the job processes: FIFO dispatch, watching, cancellation, restart recovery."""

    def __init__(self, settings: Settings, store: Store, hub: Hub, tailer: MetricsTailer) -> None:
        """Create a supervisor; :meth:`start` runs it."""
        self.settings = settings
        self.store = store
        self.hub = hub
        self.tailer = tailer
        self._lock = threading.RLock()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._cancel_deadline: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.launched_total = 0
        self.errors_total = 0
        self._last_error: dict[str | None, str] = {}
        self.slurm: SlurmJobs | None = None
        if settings.launcher == "slurm":
            self.slurm = SlurmJobs(
                settings, store, hub, tailer, self._move, on_submitted=self._count_launch
            )

    def _count_launch(self) -> None:
        self.launched_total += 1

    def _move(self, job_id: str, state: str, reason: str, **kw: Any) -> bool:
        return move_job(self.store, self.hub, job_id, state, reason, **kw)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Re-attach to jobs of a previous server and start the supervisor thread.

        Does nothing when the thread is already running.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self.slurm is not None:
                self.slurm.recover()
            else:
                self._recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dmuon-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the supervisor thread. Running jobs are left running, on purpose."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def wake(self) -> None:
        """Ask the supervisor thread to look at the jobs now."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep supervising whatever one job did
                log.exception("supervisor tick failed")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def tick(self) -> None:
        """One round: watch active jobs, then start queued ones.

        A job whose round fails is logged (once per distinct error) and left for the next
        round; the other jobs and the queue go on regardless.
        """
        with self._lock:
            if self.slurm is not None:
                self.slurm.tick(self._isolated)
                return
            for job in self.store.jobs_in_states(ACTIVE_STATES):
                with self._isolated(job["id"]):
                    self._watch(job)
            with self._isolated(None):
                self._dispatch()

    @contextlib.contextmanager
    def _isolated(self, job_id: str | None) -> Iterator[None]:
        """Log an error of one job's round (the first time it is seen) and go on."""
        try:
            yield
        except Exception as e:
            what = f"{type(e).__name__}: {e}"
            self.errors_total += 1
            if self._last_error.get(job_id) != what:
                self._last_error[job_id] = what
                log.exception("job %s: supervision round failed", job_id or "(queue)")
        else:
            self._last_error.pop(job_id, None)

    # ------------------------------------------------------------------- recovery

    def _recover(self) -> None:
        for job in self.store.jobs_in_states(ACTIVE_STATES):
            job_id = job["id"]
            if job["pid"] is None:
                # The previous server stopped between marking the job and recording its pid.
                runner = find_runner(job_id)
                if runner is not None:
                    self.store.update_job(
                        job_id,
                        pid=runner.pid,
                        pgid=os.getpgid(runner.pid),
                        create_time=runner.create_time(),
                    )
                    log.info("job %s: adopted runner pid %d", job_id, runner.pid)
                else:
                    kill_and_reap(find_job_processes(job_id), signal.SIGKILL)
                    self._move(
                        job_id,
                        "failed",
                        "the server stopped while launching the job; submit it again",
                        from_states=ACTIVE_STATES,
                    )
                continue
            proc = verified_process(job["pid"], job["create_time"])
            if proc is not None:
                log.info("job %s: re-attached to pid %d", job_id, job["pid"])
                if job["cancel_requested_at"] is not None:
                    # SIGTERM went out with the request; a second one would make the recipe
                    # stop without saving, so only the deadline is restored.
                    self._cancel_deadline[job_id] = (
                        job["cancel_requested_at"] + self.settings.cancel_grace_s
                    )
            # Jobs whose processes vanished are finalised by the first tick.

    # ------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        active = len(self.store.jobs_in_states(ACTIVE_STATES))
        free = self.settings.max_concurrent_jobs - active
        if free <= 0:
            return
        for job in self.store.jobs_in_states(["queued"])[:free]:
            self._launch(job)

    def _launch(self, job: dict[str, Any]) -> None:
        """Start a queued job: its first attempt, or a resumed one."""
        cause = "resume" if self.store.attempts(job["id"]) else "submitted"
        self._spawn(job, cause, "launching torchrun", from_states=["queued"])

    def _spawn(
        self,
        job: dict[str, Any],
        cause: str,
        reason: str,
        *,
        from_states: list[str],
        **fields: Any,
    ) -> None:
        """Move the job to ``starting``, record a new attempt and spawn its runner."""
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        spec = JobCreate.model_validate_json(job["spec"])
        plan_env = launch_env(self.settings, job_id, int(job["nproc"]))
        # Mark the job before spawning: a server that dies in between finds the job by its
        # environment marker on restart instead of launching it a second time.
        if not self._move(
            job_id,
            "starting",
            reason,
            from_states=from_states,
            pid=None,
            pgid=None,
            create_time=None,
            **fields,
        ):
            return
        latest = latest_checkpoint(job_dir / CHECKPOINT_DIR)
        resume_step = latest.step if latest is not None else None
        attempt = self.store.start_attempt(job_id, cause, resume_step)
        argv = attempt_argv(
            json.loads(job["argv"]),
            job_dir,
            attempt,
            spec.train.steps,
            resuming=latest is not None,
        )
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / SPEC_FILE).write_text(job["spec"])
            (job_dir / EXIT_FILE).unlink(missing_ok=True)  # the previous attempt's report
            with (job_dir / LOG_FILE).open("ab") as logf:
                proc = subprocess.Popen(
                    argv,
                    cwd=job_dir,
                    env=job_env(self.settings, plan_env),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as e:
            why = f"could not start the job: {e.strerror or e}"
            self.store.finish_attempt(job_id, attempt, None, why)
            self._move(job_id, "failed", why)
            return
        self._children[job_id] = proc
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self.store.update_job(job_id, pid=proc.pid, pgid=proc.pid, create_time=create_time)
        self.launched_total += 1
        log.info("job %s: attempt %d started pid %d", job_id, attempt, proc.pid)
        self.hub.notify(job_id)

    # ---------------------------------------------------------------------- watch

    def _watch(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        if job["pid"] is None:
            return  # being launched by this very thread, or adopted in _recover
        attempt = self.store.current_attempt(job_id)
        polled = self.tailer.poll(
            job_id,
            self.settings.job_dir(job_id) / metrics_file(attempt),
            stream=metrics_stream(attempt),
        )
        # A relaunched attempt keeps the points of the steps before its checkpoint: only
        # this attempt's own file tells that it runs.
        if job["state"] == "starting" and (
            polled or self.store.get_offset(job_id, metrics_stream(attempt)) > 0
        ):
            self._move(
                job_id, "running", "the first metric point arrived", from_states=["starting"]
            )
        child = self._children.get(job_id)
        if child is not None:
            ended = child.poll() is not None
        else:
            ended = verified_process(job["pid"], job["create_time"]) is None
        if not ended:
            deadline = self._cancel_deadline.get(job_id)
            if deadline is not None and time.time() >= deadline:
                root = verified_process(job["pid"], job["create_time"])
                n = signal_job(job, root, signal.SIGKILL)
                log.warning("job %s: grace period over, SIGKILL to %d process(es)", job_id, n)
                self._cancel_deadline[job_id] = float("inf")
            return
        self._finalize(job)

    def _finalize(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        attempt = self.store.current_attempt(job_id)
        self.tailer.poll(
            job_id,
            job_dir / metrics_file(attempt),
            final=True,
            stream=metrics_stream(attempt),
        )
        # Whatever survived the runner is an orphan: end it (and wait for it) now.
        leftovers = find_job_processes(job_id)
        if leftovers:
            log.warning("job %s: killing %d leftover process(es)", job_id, len(leftovers))
            kill_and_reap(leftovers, signal.SIGKILL)
        child = self._children.pop(job_id, None)
        child_rc = child.returncode if child is not None else None
        self._cancel_deadline.pop(job_id, None)
        report = read_exit_report(job_dir)
        fresh = self.store.get_job(job_id) or job
        rc = report.get("returncode") if report else child_rc
        failure = None
        cancelled_at = fresh["cancel_requested_at"]
        steps = JobCreate.model_validate_json(fresh["spec"]).train.steps
        if cancelled_at is not None and trained_to_the_end(job_dir, steps):
            state = "succeeded"
            reason = (
                f"trained all {steps} steps and saved the last checkpoint; the cancel came after"
            )
        elif cancelled_at is not None:
            state, reason = "cancelled", "cancelled on request"
            if rc is None and time.time() >= cancelled_at + self.settings.cancel_grace_s:
                # Killed after the grace period (by this server or the one before it,
                # which is then nobody's parent to learn the status).
                rc = -signal.SIGKILL
                reason = "cancelled on request; SIGKILL after the grace period"
        elif report and rc == 0:
            state, reason = "succeeded", "torchrun exited with code 0"
        else:
            state = "failed"
            failure = describe_failure(job_dir, report, child_rc, self.settings.log_tail_lines)
            public = PublicPaths(self.settings, job_dir)
            failure["log_tail"] = [public.text(line) for line in failure["log_tail"]]
            if failure["message"]:
                failure["message"] = public.text(failure["message"])
            reason = failure.pop("reason")
            rc = failure["exit_code"]
            if restartable(report, child_rc) and self._restart(fresh, attempt, rc, reason):
                return
        self.store.finish_attempt(job_id, attempt, rc, reason)
        if self._move(
            job_id,
            state,
            reason,
            from_states=ACTIVE_STATES,
            exit_code=rc,
            failure=json.dumps(failure) if failure else None,
        ):
            log.info("job %s: %s (%s)", job_id, state, reason)

    def _restart(self, job: dict[str, Any], attempt: int, rc: int | None, why: str) -> bool:
        """Relaunch a job whose attempt failed with ``why``, if restarts are left.

        Restarts are counted since the job's last submission or resume. Returns whether
        a new attempt was started.
        """
        job_id = job["id"]
        allowed = JobCreate.model_validate_json(job["spec"]).max_restarts
        used = 0
        for a in reversed(self.store.attempts(job_id)):
            if a["cause"] != "restart":
                break
            used += 1
        if used >= allowed:
            return False
        self.store.finish_attempt(job_id, attempt, rc, why)
        latest = latest_checkpoint(self.settings.job_dir(job_id) / CHECKPOINT_DIR)
        start = f"from step {latest.step}" if latest is not None else "from scratch"
        log.warning("job %s: %s; restart %d of %d", job_id, why, used + 1, allowed)
        self._spawn(
            job,
            "restart",
            f"{why}; restart {used + 1} of {allowed}, resuming {start}",
            from_states=list(ACTIVE_STATES),
            started_at=job["started_at"],
        )
        return True

    # --------------------------------------------------------------------- cancel

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Request cancellation; SIGTERM to the ranks at once (they save a checkpoint and
        exit), SIGKILL to what is left after the grace period.

        Returns the job row after the request (None for an unknown job). Idempotent.
        Raises :class:`JobFinishing` for a job that has reported its last step: it is in
        its final evaluation and checkpoint, and a cancel would only lose them.
        """
        with self._lock:
            job = self.store.get_job(job_id)
            if job is None or job["state"] in ("succeeded", "failed", "cancelled"):
                return job
            if job["state"] in ACTIVE_STATES and job["cancel_requested_at"] is None:
                steps = JobCreate.model_validate_json(job["spec"]).train.steps
                last = self.store.metric_summary(job_id).last_step
                if last is not None and last >= steps:
                    raise JobFinishing(job_id, steps)
            job = self.store.request_cancel(job_id)
            assert job is not None
            if self.slurm is not None and job["slurm_job_id"] is not None:
                self.slurm.cancel(job)
            elif job["state"] == "queued":
                self._move(job_id, "cancelled", "cancelled while queued", from_states=["queued"])
            elif job_id not in self._cancel_deadline:
                self._cancel_deadline[job_id] = time.time() + self.settings.cancel_grace_s
                root = verified_process(job["pid"], job["create_time"])
                n = signal_ranks(job, root, signal.SIGTERM)
                log.info("job %s: SIGTERM to %d process(es)", job_id, n)
                self.hub.notify(job_id)
        self.wake()
        return self.store.get_job(job_id)
