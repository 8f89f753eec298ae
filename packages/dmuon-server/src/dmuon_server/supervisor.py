"""Watching and cancelling jobs, and starting queued ones: the supervisor thread.

Every ``poll_interval_s`` the thread:

* tails each active job's metrics file into the store (``starting`` -> ``running`` once
  the first point is stored);
* notices jobs that ended (its own children are reaped with ``Popen.poll``; a job it
  re-attached to after a restart is recognised by pid *and* process create time), and
  records ``succeeded``/``failed``/``cancelled`` from the exit report, after a final
  read of the metrics file;
* escalates cancellations: SIGTERM to every process of the job at once, SIGKILL to what
  is left after ``cancel_grace_s``;
* starts queued jobs in FIFO order while fewer than ``max_concurrent_jobs`` are active.

Jobs run with stdout and stderr going to ``<job-dir>/job.log``, not to pipes, in a session
of their own, so they neither notice nor die when the server stops. How a job is launched
is :mod:`dmuon_server.launch`, how its processes are found :mod:`dmuon_server.procs`, and
what its files say :mod:`dmuon_server.jobfiles`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any

import psutil

from dmuon_server.config import Settings
from dmuon_server.jobfiles import (
    LOG_FILE,
    METRICS_FILE,
    SPEC_FILE,
    describe_failure,
    read_exit_report,
)
from dmuon_server.launch import job_env, launch_env
from dmuon_server.lifecycle import move_job
from dmuon_server.metrics import Hub, MetricsTailer
from dmuon_server.paths import PublicPaths
from dmuon_server.procs import (
    find_job_processes,
    find_runner,
    kill_and_reap,
    signal_job,
    verified_process,
)
from dmuon_server.schemas import ACTIVE_STATES
from dmuon_server.store import Store

log = logging.getLogger("dmuon_server.supervisor")


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
        """One round: watch active jobs, then start queued ones."""
        with self._lock:
            for job in self.store.jobs_in_states(ACTIVE_STATES):
                self._watch(job)
            self._dispatch()

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
                    self._cancel_deadline[job_id] = (
                        job["cancel_requested_at"] + self.settings.cancel_grace_s
                    )
                    signal_job(job, proc, signal.SIGTERM)
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
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        argv: list[str] = json.loads(job["argv"])
        plan_env = launch_env(self.settings, job_id, int(job["nproc"]))
        # Mark the job before spawning: a server that dies in between finds the job by its
        # environment marker on restart instead of launching it a second time.
        if not self._move(job_id, "starting", "launching torchrun", from_states=["queued"]):
            return
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / SPEC_FILE).write_text(job["spec"])
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
            self._move(job_id, "failed", f"could not start the job: {e.strerror or e}")
            return
        self._children[job_id] = proc
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self.store.update_job(job_id, pid=proc.pid, pgid=proc.pid, create_time=create_time)
        self.launched_total += 1
        log.info("job %s: started pid %d", job_id, proc.pid)
        self.hub.notify(job_id)

    # ---------------------------------------------------------------------- watch

    def _watch(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        if job["pid"] is None:
            return  # being launched by this very thread, or adopted in _recover
        self.tailer.poll(job_id, self.settings.job_dir(job_id) / METRICS_FILE)
        if job["state"] == "starting" and self.store.metrics_after(job_id, -1, 1):
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
        self.tailer.poll(job_id, job_dir / METRICS_FILE, final=True)
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
        if fresh["cancel_requested_at"] is not None:
            state, reason = "cancelled", "cancelled on request"
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
        if self._move(
            job_id,
            state,
            reason,
            from_states=ACTIVE_STATES,
            exit_code=rc,
            failure=json.dumps(failure) if failure else None,
        ):
            log.info("job %s: %s (%s)", job_id, state, reason)

    # --------------------------------------------------------------------- cancel

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Request cancellation; SIGTERM goes out at once, SIGKILL after the grace period.

        Returns the job row after the request (None for an unknown job). Idempotent.
        """
        with self._lock:
            job = self.store.get_job(job_id)
            if job is None or job["state"] in ("succeeded", "failed", "cancelled"):
                return job
            job = self.store.request_cancel(job_id)
            assert job is not None
            if job["state"] == "queued":
                self._move(job_id, "cancelled", "cancelled while queued", from_states=["queued"])
            elif job_id not in self._cancel_deadline:
                self._cancel_deadline[job_id] = time.time() + self.settings.cancel_grace_s
                root = verified_process(job["pid"], job["create_time"])
                n = signal_job(job, root, signal.SIGTERM)
                log.info("job %s: SIGTERM to %d process(es)", job_id, n)
                self.hub.notify(job_id)
        self.wake()
        return self.store.get_job(job_id)
