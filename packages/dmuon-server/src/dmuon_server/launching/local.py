"""Running jobs on the server's own host: torchrun under the server's runner.

A job runs as ``python -m dmuon_server.runner --job-dir DIR -- <torchrun args>`` with
stdout and stderr going to ``<job-dir>/job.log``, not to pipes, in a session of its own, so
it neither notices nor dies when the server stops. Each round (:meth:`LocalLauncher.tick`):

* each active job's metrics file is tailed into the store (``starting`` -> ``running``
  once the first point of the current attempt is stored);
* a job that ended is noticed (the server's own children by ``Popen.poll``; a job it
  re-attached to after a restart by pid *and* process create time), and its attempt is
  concluded from the exit report after a final read of the metrics file
  (:mod:`dmuon_server.launching.attempts`);
* cancellations escalate: SIGTERM to the job's ranks at once (the recipe finishes its
  step, saves a checkpoint and exits 0), SIGKILL to what is left after ``cancel_grace_s``;
* a rank stopped (SIGSTOP) while torchrun tells it to end, because another rank failed,
  is killed at once by the job's runner (:mod:`dmuon_server.runner`), so the attempt ends;
* on a full data directory a job's end is still seen (its points wait in its file), and
  the server's reserve is given back to record it (:mod:`dmuon_server.launching.full_disk`);
* a job whose user's disk quota is full (its folder lies on the user's volume,
  :mod:`dmuon_server.launching.volumes`) is stopped, and its attempt says why;
* a job whose rank died is relaunched, up to the spec's ``max_restarts`` times (see
  :func:`dmuon_server.storage.jobfiles.restartable`), on the same GPUs.

How a job is launched is :mod:`dmuon_server.launching.command`, how its processes are found
:mod:`dmuon_server.launching.procs`, and what its files say :mod:`dmuon_server.storage.jobfiles`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from dmuon_server.config import Settings
from dmuon_server.launching import attempts, sandbox
from dmuon_server.launching.attempts import Move
from dmuon_server.launching.cgroups import CgroupError, JobCgroup, JobLimits, limit_hit
from dmuon_server.launching.enforcement import LimitStatus, hold_limits
from dmuon_server.launching.full_disk import FullDisk
from dmuon_server.launching.identity import IdentityError, JobIdentities
from dmuon_server.launching.job_process import (
    env_folders,
    private_tmp_unavailable,
    start_process,
)
from dmuon_server.launching.procs import (
    find_job_processes,
    find_runner,
    kill_and_reap,
    signal_job,
    signal_ranks,
    verified_process,
)
from dmuon_server.launching.protocol import Isolated
from dmuon_server.launching.volumes import quota_bytes
from dmuon_server.schemas import ACTIVE_STATES, spec_of
from dmuon_server.storage.datadir import disk_full
from dmuon_server.storage.jobfiles import DISK_FULL_TEXT, metrics_file, read_exit_report
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import Hub, MetricsTailer, metrics_stream

log = logging.getLogger("dmuon_server.launching.local")


#: The ``/etc/hosts`` a sandboxed job with a network of its own sees, in its folder.
HOSTS_FILE = ".sandbox-hosts"


class LocalLauncher:
    """torchrun on this host (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        hub: Hub,
        tailer: MetricsTailer,
        move: Move,
        identities: JobIdentities,
    ) -> None:
        """Launch into ``settings.jobs_dir`` as the accounts ``identities`` say, and record
        through ``store`` and ``move``."""
        self.settings = settings
        self.identities = identities
        self.store = store
        self.hub = hub
        self.tailer = tailer
        self._move = move
        self.capacity: int | None = settings.job_slots
        self.launched_total = 0
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._cancel_deadline: dict[str, float] = {}
        self.full_disk = FullDisk(settings)
        #: Whether each unsandboxed job gets a /tmp and /dev/shm of its own.
        self.private_tmp = settings.sandbox == "none" and private_tmp_unavailable() is None
        self.held = hold_limits(settings, identities.users.all())
        self.cgroups, self.volumes = self.held.cgroups, self.held.volumes
        identities.users.check_reloads_with(lambda users: self.held.recheck(settings, users))
        self._cgroup: dict[str, JobCgroup] = {}
        #: Why a job was stopped for its user's disk quota, by job id.
        self._over_quota: dict[str, str] = {}

    @property
    def limit_statuses(self) -> tuple[LimitStatus, ...]:
        """The status of each kind of limit for the users served now."""
        return self.held.statuses

    # ------------------------------------------------------------------- recovery

    def recover(self) -> None:
        """Re-attach to the jobs of a previous server: by pid and create time, or, for a
        job whose pid was not recorded yet, by its environment marker. Cancel deadlines are
        restored; a job whose processes vanished is concluded by the first round. Volumes
        a reboot unmounted are mounted again first."""
        if self.volumes is not None:
            bound = self.volumes.restore()
            if bound:
                log.info("mounted %d job folder(s) on their users' volumes again", bound)
        for job in self.store.jobs_in_states(ACTIVE_STATES):
            if job.pid is None:
                # The previous server stopped between marking the job and recording its pid.
                runner = find_runner(job.id)
                if runner is not None:
                    self.store.update_job(
                        job.id,
                        pid=runner.pid,
                        pgid=os.getpgid(runner.pid),
                        create_time=runner.create_time(),
                    )
                    log.info("job %s: adopted runner pid %d", job.id, runner.pid)
                else:
                    kill_and_reap(find_job_processes(job.id), signal.SIGKILL)
                    self._move(
                        job.id,
                        JobState.FAILED,
                        "the server stopped while launching the job; submit it again",
                        from_states=ACTIVE_STATES,
                    )
                continue
            if verified_process(job.pid, job.create_time) is not None:
                log.info("job %s: re-attached to pid %d", job.id, job.pid)
                if job.cancel_requested_at is not None:
                    # SIGTERM went out with the request; a second one would make the recipe
                    # stop without saving, so only the deadline is restored.
                    self._cancel_deadline[job.id] = (
                        job.cancel_requested_at + self.settings.cancel_grace_s
                    )

    # ---------------------------------------------------------------------- start

    def waiting(self, job: JobRecord) -> bool:
        """Every queued job waits in the service's queue until it is started."""
        return True

    def start(self, job: JobRecord, gpus: list[int]) -> None:
        """Start a queued job: its first attempt, or a resumed one."""
        cause = attempts.next_cause(self.store, job)
        self._spawn(job, cause, "launching torchrun", gpus, from_states=[JobState.QUEUED])

    def _spawn(
        self,
        job: JobRecord,
        cause: str,
        reason: str,
        gpus: list[int],
        *,
        from_states: list[JobState],
        started_at: float | None = None,
    ) -> None:
        """Move the job to ``starting``, record a new attempt and spawn its runner."""
        fields = {"started_at": started_at} if started_at is not None else {}
        # Mark the job before spawning: a server that dies in between finds the job by its
        # environment marker on restart instead of launching it a second time.
        if not self._move(
            job.id,
            JobState.STARTING,
            reason,
            from_states=from_states,
            pid=None,
            pgid=None,
            create_time=None,
            gpus=json.dumps(gpus),
            **fields,
        ):
            return
        job_dir = self.settings.job_dir(job.id)
        try:
            self._place_on_volume(job)
            start = attempts.begin(self.settings, self.store, job, cause, gpus, self.identities)
        except (IdentityError, OSError) as e:
            why = (
                f"could not choose the job's Unix account: {e}"
                if isinstance(e, IdentityError)
                else f"could not prepare the job's folder: {e.strerror or e}"
            )
            attempts.fail_to_start(
                self.store,
                self._move,
                job.id,
                self.store.current_attempt(job.id),
                why,
                ACTIVE_STATES,
            )
            return
        try:
            argv = start.argv
            if self.settings.sandbox == "bwrap":
                argv = sandbox.wrap(
                    argv,
                    job_dir=job_dir,
                    env=start.env,
                    read_only=self._read_only_roots(),
                    gpus=bool(gpus),
                    host_network=self.settings.host_network
                    or self.identities.users.host_network_of(job.user or ""),
                    hidden=self.settings.server_files,
                    hosts_file=sandbox.write_loopback_hosts(job_dir / HOSTS_FILE),
                )
            roots = self._read_only_roots()
            private = _needed_folders(job_dir, start, roots) if self.private_tmp else None
            cgroup = self._new_cgroup(job, start.number)
            proc = start_process(argv, job_dir, start, cgroup, private)
        except OSError as e:
            why = f"could not start the job: {e.strerror or e}"
            attempts.fail_to_start(self.store, self._move, job.id, start.number, why, ACTIVE_STATES)
            self._end_cgroup(job.id)
            return
        self._children[job.id] = proc
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self.store.update_job(job.id, pid=proc.pid, pgid=proc.pid, create_time=create_time)
        self.launched_total += 1
        log.info("job %s: attempt %d started pid %d on GPUs %s", job.id, start.number, proc.pid,
                 gpus or "none")  # fmt: skip
        self.hub.notify(job.id)

    def _place_on_volume(self, job: JobRecord) -> None:
        """Put the job's folder on its user's volume where the user has a disk quota."""
        quota = self.identities.users.limits_of(job.user).disk_gib
        if quota is not None and self.volumes is not None and job.user:
            self.volumes.place(job.user, quota_bytes(quota), job.id)

    def _stop_over_quota(self, job: JobRecord) -> None:
        """Kill a job whose user's volume is full, and keep the cause for its attempt."""
        quota = self.identities.users.limits_of(job.user).disk_gib
        self._stop_for_limit(
            job,
            f"stopped: user {job.user}'s disk quota on the data directory "
            f"({quota:g} GiB, disk_gib in the users file) is full; delete finished jobs or "
            "checkpoints (keep_checkpoints), or ask for a larger disk_gib",
        )

    def _stop_for_limit(self, job: JobRecord, cause: str) -> None:
        """Kill ``job`` for a limit of the server's and keep ``cause`` for its attempt's
        failure (its quota, or what its metrics may cost)."""
        self._over_quota[job.id] = cause
        n = self._kill(job)
        log.warning("job %s: %s; SIGKILL to %d process(es)", job.id, cause, n)

    def _kill(self, job: JobRecord) -> int:
        """SIGKILL to every process of the job, its cgroup's included; how many."""
        n = signal_job(job, verified_process(job.pid, job.create_time), signal.SIGKILL)
        cgroup = self._cgroup_of(job)
        return n + (cgroup.kill() if cgroup is not None else 0)

    def _limits_of(self, job: JobRecord) -> JobLimits:
        """The kernel's limits of ``job``: the server's, with its user's memory_gib."""
        settings = self.settings
        memory, source = self.identities.users.limits_of(job.user).job_memory(
            settings.max_job_memory
        )
        return JobLimits(memory, settings.max_job_pids, settings.max_job_cpus, source)

    def _new_cgroup(self, job: JobRecord, attempt: int) -> JobCgroup | None:
        """The cgroup of a new attempt (None where the machine has none to give)."""
        if self.cgroups is None:
            return None
        self._end_cgroup(job.id)  # the previous attempt's, if a restart
        try:
            cgroup = self.cgroups.create(f"{job.id}-{attempt}", self._limits_of(job))
        except CgroupError as e:
            raise OSError(e.errno, f"{e.strerror} ({e.filename})") from None
        self._cgroup[job.id] = cgroup
        return cgroup

    def _cgroup_of(self, job: JobRecord) -> JobCgroup | None:
        """The cgroup of the job's current attempt (also one an earlier server made)."""
        cgroup = self._cgroup.get(job.id)
        if cgroup is None and self.cgroups is not None:
            attempt = self.store.current_attempt(job.id)
            cgroup = self.cgroups.existing(f"{job.id}-{attempt}")
            if cgroup is not None:
                self._cgroup[job.id] = cgroup
        return cgroup

    def _end_cgroup(self, job_id: str) -> None:
        """Kill whatever is left in the job's cgroup, and remove it."""
        cgroup = self._cgroup.pop(job_id, None)
        if cgroup is not None:
            left = cgroup.kill()
            if left:
                log.warning("job %s: killed %d process(es) left in its cgroup", job_id, left)
            cgroup.remove()

    def _read_only_roots(self) -> list[Path]:
        """What a sandboxed job may read besides its code: the code, data and model roots."""
        s = self.settings
        return [*s.code_roots, *s.data_roots, *s.model_roots]

    # ---------------------------------------------------------------------- watch

    def tick(self, isolated: Isolated) -> None:
        """Watch every active job once (see the module docstring)."""
        self.full_disk.replenish()
        for job in self.store.jobs_in_states(ACTIVE_STATES):
            with isolated(job.id):
                self._watch(job)

    def _watch(self, job: JobRecord) -> None:
        if job.pid is None:
            # recover() adopted or failed every such job of a previous server, and this
            # thread launches jobs in full: a launch of an earlier round stopped midway (a
            # write failed on a full disk). Record its pid now, or fail it.
            child = self._children.get(job.id)
            if child is not None:
                try:
                    create_time = psutil.Process(child.pid).create_time()
                except psutil.Error:
                    create_time = time.time()
                self.store.update_job(
                    job.id, pid=child.pid, pgid=child.pid, create_time=create_time
                )
            else:
                self._move(
                    job.id,
                    JobState.FAILED,
                    "the job could not be launched (the server's writes failed"
                    + (f": {DISK_FULL_TEXT})" if disk_full(self.settings.jobs_dir) else ")"),
                    from_states=ACTIVE_STATES,
                )
            return
        attempt = self.store.current_attempt(job.id)
        path = self.settings.job_dir(job.id) / metrics_file(attempt)
        polled = self.full_disk.poll(
            job.id,
            lambda: self.tailer.poll(job.id, path, stream=metrics_stream(attempt), attempt=attempt),
        )
        # A relaunched attempt keeps the points of the steps before its checkpoint: only
        # this attempt's own file tells that it runs.
        if job.state == JobState.STARTING and (
            polled or self.store.get_offset(job.id, metrics_stream(attempt)) > 0
        ):
            self._move(
                job.id,
                JobState.RUNNING,
                "the first metric point arrived",
                from_states=[JobState.STARTING],
            )
        child = self._children.get(job.id)
        if child is not None:
            ended = child.poll() is not None
        else:
            ended = verified_process(job.pid, job.create_time) is None
        if (
            not ended
            and self.volumes is not None
            and job.id not in self._over_quota
            and self.volumes.full(self.settings.job_dir(job.id))
        ):
            self._stop_over_quota(job)
        over = self.tailer.over_limit.get(job.id)
        if not ended and over is not None and job.id not in self._over_quota:
            self._stop_for_limit(job, over)
        if not ended:
            deadline = self._cancel_deadline.get(job.id)
            if deadline is not None and time.time() >= deadline:
                n = self._kill(job)
                log.warning("job %s: grace period over, SIGKILL to %d process(es)", job.id, n)
                self._cancel_deadline[job.id] = float("inf")
            return
        self._finish(job, attempt)

    def _finish(self, job: JobRecord, attempt: int) -> None:
        """Conclude the ended attempt; on a full disk, give the server's reserve back and
        write it again at once, before anything else takes the space."""
        # Judged before anything is written: a full disk may be why the runner left no
        # report, and the reserve may go below.
        # A job stopped for its user's quota filled its volume, not the data directory.
        full = job.id not in self._over_quota and self.full_disk.full_at_end(
            job.id, self.settings.job_dir(job.id)
        )
        self.full_disk.record(job.id, lambda: self._conclude(job, attempt, full))

    def _conclude(self, job: JobRecord, attempt: int, full: bool) -> None:
        job_dir = self.settings.job_dir(job.id)
        attempts.final_poll(self.settings, self.tailer, job, attempt)
        # Whatever survived the runner is an orphan: end it (and wait for it) now, and
        # everything in the job's cgroup (a process that left its session and environment).
        leftovers = find_job_processes(job.id)
        if leftovers:
            log.warning("job %s: killing %d leftover process(es)", job.id, len(leftovers))
            kill_and_reap(leftovers, signal.SIGKILL)
        cgroup = self._cgroup_of(job)
        stopped_by = self._over_quota.pop(job.id, None) or (
            limit_hit(cgroup, self._limits_of(job)) if cgroup is not None else None
        )
        self._end_cgroup(job.id)
        # The child is forgotten only once the outcome is recorded: a round whose write
        # fails (a full disk) is repeated with its exit status.
        child = self._children.get(job.id)
        child_rc = child.returncode if child is not None else None
        self._cancel_deadline.pop(job.id, None)
        fresh = self.store.get_job(job.id) or job
        report = read_exit_report(job_dir)
        outcome = attempts.conclude(self.settings, fresh, report, child_rc, disk_full=full)
        if stopped_by is not None and outcome.state == JobState.FAILED:
            # The kernel's limit is the cause: say so first, and do not try again.
            failure = {**(outcome.failure or {}), "limit": stopped_by}
            reason = f"{stopped_by}; {outcome.reason}" if outcome.reason else stopped_by
            outcome = dataclasses.replace(outcome, reason=reason, failure=failure, retry=False)
        if outcome.retry and self._restart(fresh, attempt, outcome):
            self.full_disk.forget(job.id)
            return
        if attempts.record(self.store, self._move, job.id, attempt, outcome, ACTIVE_STATES):
            log.info("job %s: %s (%s)", job.id, outcome.state, outcome.reason)
        self._children.pop(job.id, None)
        self.full_disk.forget(job.id)
        self.tailer.forget(job.id)

    def _restart(self, job: JobRecord, attempt: int, outcome: attempts.Outcome) -> bool:
        """Relaunch a job whose attempt failed, if restarts are left; whether it was.

        Restarts are counted since the job's last submission or resume, and keep the
        job's GPUs.
        """
        allowed = spec_of(job).max_restarts
        used = attempts.restarts_used(self.store, job.id)
        if used >= allowed:
            return False
        self.store.finish_attempt(job.id, attempt, outcome.exit_code, outcome.reason)
        latest = attempts.resume_point(self.settings, job)
        start = f"from step {latest.step}" if latest is not None else "from scratch"
        log.warning("job %s: %s; restart %d of %d", job.id, outcome.reason, used + 1, allowed)
        self._spawn(
            job,
            "restart",
            f"{outcome.reason}; restart {used + 1} of {allowed}, resuming {start}",
            job.gpu_list,
            from_states=list(ACTIVE_STATES),
            started_at=job.started_at,
        )
        return True

    # --------------------------------------------------------------------- cancel

    def cancel(self, job: JobRecord) -> None:
        """SIGTERM to the ranks at once (they save a checkpoint and exit); SIGKILL to what
        is left after the grace period (in :meth:`tick`)."""
        if job.id in self._cancel_deadline:
            return
        self._cancel_deadline[job.id] = time.time() + self.settings.cancel_grace_s
        root = verified_process(job.pid, job.create_time)
        n = signal_ranks(job, root, signal.SIGTERM)
        log.info("job %s: SIGTERM to %d process(es)", job.id, n)
        self.hub.notify(job.id)


def _needed_folders(job_dir: Path, start: attempts.AttemptStart, roots: list[Path]) -> list[Path]:
    """The folders an unsandboxed job needs from the host's /tmp: its own, its code, its
    home, those its environment names, and the roots (see
    :mod:`dmuon_server.launching.job_process`)."""
    pythonpath = [p for p in start.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    home = [start.env["HOME"]] if "HOME" in start.env else []
    code = sandbox.code_dirs(pythonpath)
    return [job_dir, *map(Path, [*code, *home]), *env_folders(start.env), *roots]
