"""Scheduling: which queued job starts when, over a launcher that runs it.

A thread runs a round every ``poll_interval_s`` (and when woken): the launcher follows the
jobs it launched (:meth:`dmuon_server.launching.protocol.Launcher.tick`), then the
queue policy (:mod:`dmuon_server.scheduling.queue_policy`) picks the queued jobs that start
now, with their GPUs, and the launcher starts them. A queued job's place in the queue, and
why it waits, are computed the same way for the API (:meth:`Supervisor.queue_places`). The
supervisor itself runs no process and knows no launcher's details: the local host
(:mod:`dmuon_server.launching.local`) and Slurm (:mod:`dmuon_server.launching.slurm_jobs`)
offer the same interface, and the app gives it the one to use.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from dmuon_server.config import Settings
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.launching.protocol import Launcher
from dmuon_server.recipe.review import gpus_of_job, gpus_per_node
from dmuon_server.scheduling import queue_policy
from dmuon_server.scheduling.lifecycle import move_job
from dmuon_server.scheduling.queue_policy import Holding, Place, Plan, Waiting
from dmuon_server.schemas import ACTIVE_STATES, TERMINAL_STATES, spec_of
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store, StoreFull
from dmuon_server.streams.metrics import Hub, MetricsTailer

log = logging.getLogger("dmuon_server.scheduling.supervisor")


class JobFinishing(Exception):
    """A cancel of a job that has trained all its steps and is finishing."""

    def __init__(self, job_id: str, steps: int) -> None:
        """Name the job and its steps."""
        super().__init__(job_id)
        self.job_id = job_id
        self.steps = steps


class Supervisor:
    """The scheduling thread over one launcher (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        hub: Hub,
        tailer: MetricsTailer,
        launcher: Launcher,
        *,
        identities: JobIdentities,
    ) -> None:
        """Create a supervisor over ``launcher`` (jobs run as ``identities`` say);
        :meth:`start` runs it."""
        self.identities = identities
        self._cached_places: tuple[tuple[int, int], dict[str, Place]] | None = None
        self.settings = settings
        self.store = store
        self.hub = hub
        self.tailer = tailer
        self.launcher = launcher
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors_total = 0
        self._last_error: dict[str | None, str] = {}
        self._places: dict[str, Place] = {}
        #: (store version, users generation) of the last round that started nothing.
        self._idle_key: tuple[int, int] | None = None

    @property
    def launched_total(self) -> int:
        """Attempts launched by this server process."""
        return self.launcher.launched_total

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Re-attach to jobs of a previous server and start the thread (if not running)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.launcher.recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dmuon-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread. Running jobs are left running, on purpose."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def wake(self) -> None:
        """Ask the thread to look at the jobs now."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep supervising whatever one round did
                log.exception("supervisor round failed")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def tick(self) -> None:
        """One round: the launcher follows its jobs, then queued jobs start.

        A job whose round fails is logged (once per distinct error) and left for the next
        round; the other jobs and the queue go on regardless.
        """
        with self._lock:
            self.launcher.tick(self._isolated)
            with self._isolated(None):
                self._schedule()

    @contextlib.contextmanager
    def _isolated(self, job_id: str | None) -> Iterator[None]:
        """Log an error of one job's round (the first time it is seen) and go on."""
        try:
            yield
        except Exception as e:
            self._note_error(job_id, e)
        else:
            self._last_error.pop(job_id, None)

    def _note_error(self, job_id: str | None, e: Exception) -> None:
        """Count an error of a round and log it the first time it is seen for the job (a
        full disk once, whatever its message says of the free space)."""
        what = type(e).__name__ if isinstance(e, StoreFull) else f"{type(e).__name__}: {e}"
        self.errors_total += 1
        if self._last_error.get(job_id) != what:
            self._last_error[job_id] = what
            log.error("job %s: supervision round failed", job_id or "(queue)", exc_info=e)

    # ------------------------------------------------------------------ scheduling

    def _plan(self) -> tuple[Plan, dict[str, JobRecord]]:
        in_queue = self.store.jobs_in_states([JobState.QUEUED])
        queued = [j for j in in_queue if self.launcher.waiting(j)]
        active = self.store.jobs_in_states(ACTIVE_STATES)
        busy = [d for j in active for d in j.gpu_list]
        # What each user holds: their active jobs, and the queued ones the launcher has
        # already handed on (submitted to Slurm, which picks their devices).
        launched = active + [j for j in in_queue if not self.launcher.waiting(j)]
        holding: dict[str | None, Holding] = {}
        for j in launched:
            had = holding.get(j.user, Holding())
            used = len(j.gpu_list) or gpus_of_job(self.settings, spec_of(j))
            holding[j.user] = Holding(had.jobs + 1, had.gpus + used)
        users = self.identities.users
        local = self.settings.launcher == "local"
        waiting = [
            Waiting(
                j.id,
                gpus_of_job(self.settings, spec_of(j)),
                j.priority,
                j.user,
                users.limits_of(j.user),
                devices=gpus_per_node(self.settings, spec_of(j)) if local else 0,
            )
            for j in queued
        ]
        plan = queue_policy.plan(
            waiting,
            devices=self.settings.gpus,
            busy=busy,
            running=len(launched),
            capacity=self.launcher.capacity,
            holding=holding,
        )
        return plan, {j.id: j for j in queued}

    def _schedule(self) -> None:
        # What the plan depends on changes only with the jobs table or the users: a round
        # after one that started nothing, with neither changed, has nothing to do (planning
        # costs O(queue) a round, several times a second).
        key = (self.store.version, self.identities.users.generation)
        if key == self._idle_key:
            return
        plan, queued = self._plan()
        self._idle_key = None if plan.starts else key
        for job_id, gpus in plan.starts:
            with self._isolated(job_id):
                self.launcher.start(queued[job_id], gpus)
        # A queued job's stream shows its place: wake those whose place changed.
        places = plan.places
        for job_id in set(places) | set(self._places):
            if places.get(job_id) != self._places.get(job_id):
                self.hub.notify(job_id)
        self._places = places

    def queue_places(self) -> dict[str, Place]:
        """Where each job waiting in the service's queue stands, and why (as the next
        round would see it).

        Computed once per change of the jobs table or the users (their limits), not per
        request: a request between changes costs a dictionary lookup."""
        key = (self.store.version, self.identities.users.generation)
        cached = self._cached_places
        if cached is not None and cached[0] == key:
            return cached[1]
        places = self._plan()[0].places
        self._cached_places = (key, places)
        return places

    # --------------------------------------------------------------------- cancel

    def cancel(self, job_id: str) -> JobRecord | None:
        """Request cancellation: a job waiting in the queue is cancelled at once, a launched
        one is stopped by its launcher (it may save a checkpoint first).

        Returns the job after the request (None for an unknown job). Idempotent.
        Raises :class:`JobFinishing` for a job that has reported its last step: it is in
        its final evaluation and checkpoint, and a cancel would only lose them.
        """
        with self._lock:
            job = self.store.get_job(job_id)
            if job is None or job.state in TERMINAL_STATES:
                return job
            steps = spec_of(job).steps
            if job.state in ACTIVE_STATES and job.cancel_requested_at is None and steps:
                last = self.store.metric_summary(job_id).last_step
                if last is not None and last >= steps:
                    raise JobFinishing(job_id, steps)
            job = self.store.request_cancel(job_id)
            assert job is not None
            if job.state == JobState.QUEUED and self.launcher.waiting(job):
                move_job(
                    self.store,
                    self.hub,
                    job_id,
                    JobState.CANCELLED,
                    "cancelled while queued",
                    from_states=[JobState.QUEUED],
                )
            else:
                self.launcher.cancel(job)
        self.wake()
        return self.store.get_job(job_id)
