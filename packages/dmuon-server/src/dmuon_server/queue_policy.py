"""Which queued jobs start now, and why the others wait.

The queue is ordered by priority (higher first), then by the time a job was queued. A job
starts when a slot is free (``--max-concurrent-jobs``) and the GPUs it needs are free, and
only once every job ahead of it has started: there is no backfill, so a small job that
would fit waits behind a larger one ahead of it, and the larger one is never starved by a
stream of small ones. A job that should pass goes in with a higher priority.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dmuon_server.gpus import allocate


@dataclass(frozen=True)
class Waiting:
    """A queued job as the policy sees it: its id and the GPUs it needs (0: none)."""

    job_id: str
    gpus: int = 0


@dataclass(frozen=True)
class Place:
    """Where a waiting job stands: 1 for the next to start, and why it waits."""

    position: int
    reason: str


@dataclass
class Plan:
    """What to do now: the jobs to start with their devices, and where every queued job
    stands (those starting now first)."""

    starts: list[tuple[str, list[int]]] = field(default_factory=list)
    places: dict[str, Place] = field(default_factory=dict)


def _n(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def plan(
    queue: Sequence[Waiting],
    *,
    devices: Sequence[int] = (),
    busy: Sequence[int] = (),
    running: int = 0,
    capacity: int | None = None,
) -> Plan:
    """Start what the queue's head allows; say for every other job why it waits.

    ``devices`` are the server's GPUs, ``busy`` those the active jobs hold, ``running``
    how many jobs are active and ``capacity`` how many may be (None: no limit).
    """
    out = Plan()
    taken = set(busy)
    slots = None if capacity is None else capacity - running
    blocked: list[Waiting] = []
    for job in queue:
        if not blocked and (slots is None or slots > 0):
            got = allocate(devices, taken, job.gpus)
            if got is not None:
                out.starts.append((job.job_id, got))
                taken.update(got)
                if slots is not None:
                    slots -= 1
                continue
        blocked.append(job)
    for i, (job_id, _) in enumerate(out.starts):
        out.places[job_id] = Place(i + 1, "next to start")
    free = len([d for d in devices if d not in taken])
    active = running + len(out.starts)
    first = len(out.starts) + 1
    for ahead, job in enumerate(blocked):
        clauses = []
        if job.gpus > len(devices):
            clauses.append(
                f"needs {_n(job.gpus, 'GPU')}, more than this server has ({len(devices)}, "
                "--gpus); cancel it"
            )
        elif job.gpus > free:
            clauses.append(f"waiting for {_n(job.gpus, 'GPU')}: {free} free")
        if slots is not None and slots <= 0:
            clauses.append(f"{active} of {capacity} running (--max-concurrent-jobs)")
        if ahead:
            clauses.append(f"{_n(ahead, 'job')} ahead")
        out.places[job.job_id] = Place(first + ahead, ", ".join(clauses) or "next to start")
    return out
