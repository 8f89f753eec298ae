"""Typed rows of the store, as every module reads them: a job, one of its attempts, one of
its transitions, one of the recipe's events, one metric point."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, fields
from typing import Any

from dmuon_server.storage.states import JobState


@dataclass(frozen=True)
class JobRecord:
    """A stored job.

    Attributes:
        seq: Insertion order (the key of its metric points).
        id: The job's id.
        name: Its label, or None.
        state: Where it stands.
        nproc: Processes per node.
        spec: The accepted spec as canonical JSON (:func:`dmuon_server.schemas.spec_of`
            parses it).
        spec_hash: What its idempotency key binds.
        idempotency_key: The key it was submitted with, or None.
        created_at, started_at, finished_at: Unix times.
        exit_code: Exit code of its latest attempt (negative: a signal).
        reason: Reason of the latest transition.
        pid, pgid, create_time: The local runner process (pid and create time identify it).
        cancel_requested_at: When a cancel was first requested, or None.
        failure: The failure report as JSON, or None.
        recipe_summary: The trainer's own final summary as JSON, or None.
        argv: The first attempt's runner command line as JSON.
        slurm_job_id: Slurm's id of its latest attempt (Slurm launcher only).
        queue_seq: Queue order within a priority (a job queued again goes to the end).
        user: Name of the user who submitted it (None on a server without users).
        priority: Higher starts first.
        gpus: The devices it holds while active, as JSON (a list of indices), or None.
    """

    seq: int
    id: str
    name: str | None
    state: JobState
    nproc: int
    spec: str
    spec_hash: str
    idempotency_key: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    exit_code: int | None
    reason: str | None
    pid: int | None
    pgid: int | None
    create_time: float | None
    cancel_requested_at: float | None
    failure: str | None
    recipe_summary: str | None
    argv: str | None
    slurm_job_id: str | None
    queue_seq: int | None
    user: str | None
    priority: int
    gpus: str | None

    @classmethod
    def from_row(cls, row: sqlite3.Row | dict[str, Any]) -> JobRecord:
        """The record of a ``jobs`` row (its columns by name)."""
        keys = row.keys()
        values = {f.name: row[f.name] if f.name in keys else None for f in fields(cls)}
        return cls(**{**values, "state": JobState(values["state"])})

    @property
    def argv_list(self) -> list[str]:
        """The first attempt's runner command line."""
        return json.loads(self.argv) if self.argv else []

    @property
    def gpu_list(self) -> list[int]:
        """The devices it holds (empty when none)."""
        return json.loads(self.gpus) if self.gpus else []


@dataclass(frozen=True)
class AttemptRecord:
    """One launch of a job's processes."""

    job_id: str
    number: int
    cause: str
    resumed_from_step: int | None
    started_at: float
    finished_at: float | None
    exit_code: int | None
    reason: str | None
    slurm_job_id: str | None

    @classmethod
    def from_row(cls, row: sqlite3.Row | dict[str, Any]) -> AttemptRecord:
        """The record of an ``attempts`` row."""
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class TransitionRecord:
    """One move of a job: its new state, why, and when (a Unix time); ``id`` grows."""

    id: int
    state: JobState
    reason: str
    at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row | dict[str, Any]) -> TransitionRecord:
        """The record of a ``transitions`` row."""
        return cls(row["id"], JobState(row["state"]), row["reason"], row["at"])


@dataclass(frozen=True)
class StoredEvent:
    """One of the recipe's events as the job keeps it (see `dmuon_server.storage.points`);
    ``id`` grows, ``at`` is when it was stored."""

    id: int
    attempt: int
    kind: str
    level: str
    message: str
    step: int | None
    at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row | dict[str, Any]) -> StoredEvent:
        """The record of an ``events`` row."""
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class PointRecord:
    """One stored metric point: its step, its line of the metrics file (strict JSON) and
    when it was received."""

    step: int
    data: str
    received_at: float
