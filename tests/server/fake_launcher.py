"""A launcher that starts no process, for the route tests that need jobs but not real ones.

A started job moves to ``starting`` and ``running`` as the local launcher's do, then stores
one metric point (``step``, ``loss``) per tick of the supervisor until it has ``train.steps``
of them (one for a script job) and succeeds with exit code 0; a cancel ends it at the next
tick. Everything goes through the store and the state-changing ``move`` the app gives every
launcher, so the routes, the queue and the event streams see what they see of a real job,
without torchrun, a Python interpreter per rank, or their seconds of start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dmuon_server.config import Settings
from dmuon_server.launching import attempts
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.launching.protocol import Isolated, Move
from dmuon_server.schemas import ACTIVE_STATES
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import Hub, MetricsTailer


@dataclass
class _Run:
    attempt: int
    steps: int
    done: int = 0


class FakeLauncher:
    """Runs each job in the supervisor's ticks, a point per tick (see the module)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        hub: Hub,
        tailer: MetricsTailer,
        move: Move,
        identities: JobIdentities,
    ) -> None:
        self.store = store
        self.hub = hub
        self.move = move
        self.capacity: int | None = settings.job_slots
        self.launched_total = 0
        self.limit_statuses = ()  # a fake runs nothing the kernel would hold
        self._runs: dict[str, _Run] = {}

    def recover(self) -> None:
        """Nothing survives a fake server."""

    def waiting(self, job: JobRecord) -> bool:
        """Every queued job waits in the service's queue."""
        return True

    def start(self, job: JobRecord, gpus: list[int]) -> None:
        """Start the job's first attempt."""
        if not self.move(job.id, "starting", "fake launch", from_states=["queued"]):
            return
        spec: dict[str, Any] = json.loads(job.spec)
        steps = int((spec.get("train") or {}).get("steps") or 1)
        attempt = self.store.start_attempt(job.id, attempts.next_cause(self.store, job), None)
        self._runs[job.id] = _Run(attempt, steps)
        self.launched_total += 1
        self.move(job.id, "running", "fake process started", from_states=["starting"])

    def cancel(self, job: JobRecord) -> None:
        """End the job at the next tick (its cancel request is recorded)."""

    def tick(self, isolated: Isolated) -> None:
        """Advance every running job by one point; end the cancelled and the finished."""
        for job_id, run in list(self._runs.items()):
            with isolated(job_id):
                job = self.store.get_job(job_id)
                if job is None or job.state not in ACTIVE_STATES:
                    del self._runs[job_id]
                    continue
                if job.cancel_requested_at is not None:
                    self._end(job_id, run, "cancelled", None, "cancelled on request")
                    continue
                point = {"step": run.done, "loss": 10.0 / (run.done + 1)}
                self.store.ingest(job_id, "metrics", run.done + 1, [(run.done, point)])
                self.hub.notify(job_id)
                run.done += 1
                if run.done >= run.steps:
                    self._end(job_id, run, "succeeded", 0, "all steps trained")

    def _end(self, job_id: str, run: _Run, state: str, code: int | None, why: str) -> None:
        self.store.finish_attempt(job_id, run.attempt, code, why)
        self.move(job_id, state, why, from_states=list(ACTIVE_STATES), exit_code=code)
        del self._runs[job_id]
