"""Which queued jobs start now, and why the others wait.

The queue is ordered by priority (higher first); within a priority, users take turns (a
user's first queued job, then every user's second, ...; `fair_order`), and each user's
jobs keep the order they were queued in. A job starts when a slot is free
(``--max-concurrent-jobs``) and the GPUs it needs are free, and only once every job ahead
of it has started: there is no backfill, so a small job that would fit waits behind a
larger one ahead of it, and the larger one is never starved by a stream of small ones. A
job that should pass goes in with a higher priority.

A job whose user already holds their ``running_jobs`` or ``gpus`` limit (the users file)
is passed over, not waited for: it does not hold up other users' jobs behind it, and its
``queue_reason`` names the limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dmuon_server.scheduling.gpus import allocate
from dmuon_server.schemas.views import Place
from dmuon_server.users import Limits


@dataclass(frozen=True)
class Waiting:
    """A queued job as the policy sees it: its id, the GPUs it uses (0: none; what its
    user's ``gpus`` limit counts), its priority, its user and that user's limits, and the
    devices of this server it takes (None: as many as its GPUs; 0 under Slurm, which
    picks the devices itself)."""

    job_id: str
    gpus: int = 0
    priority: int = 0
    user: str | None = None
    limits: Limits = field(default_factory=Limits)
    devices: int | None = None

    @property
    def local_devices(self) -> int:
        """The devices of this server it takes."""
        return self.gpus if self.devices is None else self.devices


@dataclass(frozen=True)
class Holding:
    """What one user's launched jobs hold: active ones, and under Slurm also those
    submitted and pending there."""

    jobs: int = 0
    gpus: int = 0


def fair_order(queue: Sequence[Waiting]) -> list[Waiting]:
    """``queue`` (priority first, then queue order) with users taking turns within each
    priority: every user's first job, then every user's second, ..., each turn in the order
    of the users' jobs in ``queue``."""
    seen: dict[tuple[int, str | None], int] = {}
    keyed = []
    for index, job in enumerate(queue):
        turn = seen.get((job.priority, job.user), 0)
        seen[(job.priority, job.user)] = turn + 1
        keyed.append((-job.priority, turn, index, job))
    return [job for *_, job in sorted(keyed, key=lambda k: k[:3])]


def _over_limit(job: Waiting, held: Holding) -> str | None:
    """Why ``job``'s user may not start it now (their limits), or None."""
    limits, who = job.limits, job.user or "this user"
    if limits.running_jobs is not None and held.jobs >= limits.running_jobs:
        return f"{who} has {held.jobs} of {limits.running_jobs} jobs running (their limit)"
    if limits.gpus is not None and held.gpus + job.gpus > limits.gpus:
        return (
            f"{who} holds {held.gpus} of {limits.gpus} GPUs and this job needs {job.gpus} "
            "(their limit)"
        )
    return None


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
    holding: Mapping[str | None, Holding] | None = None,
) -> Plan:
    """Start what the queue's head allows; say for every other job why it waits.

    ``devices`` are the server's GPUs, ``busy`` those the active jobs hold, ``running``
    how many jobs are active and ``capacity`` how many may be (None: no limit);
    ``holding`` what each user's active jobs hold, for their limits.
    """
    out = Plan()
    taken = set(busy)
    slots = None if capacity is None else capacity - running
    held = dict(holding or {})
    blocked: list[Waiting] = []
    passed: dict[str, str] = {}  # over their user's limit: why
    held_up = False  # a job ahead waits for room: no later one may pass it
    for job in fair_order(queue):
        mine = held.get(job.user, Holding())
        over = _over_limit(job, mine)
        if over is not None:
            passed[job.job_id] = over
            blocked.append(job)
            continue
        if not held_up and (slots is None or slots > 0):
            got = allocate(devices, taken, job.local_devices)
            if got is not None:
                out.starts.append((job.job_id, got))
                taken.update(got)
                held[job.user] = Holding(mine.jobs + 1, mine.gpus + job.gpus)
                if slots is not None:
                    slots -= 1
                continue
        held_up = True
        blocked.append(job)
    for i, (job_id, _) in enumerate(out.starts):
        out.places[job_id] = Place(i + 1, "next to start")
    free = len([d for d in devices if d not in taken])
    active = running + len(out.starts)
    first = len(out.starts) + 1
    for ahead, job in enumerate(blocked):
        if job.job_id in passed:
            clauses = [passed[job.job_id]]  # the user's limit, whatever else holds
        else:
            clauses = []
            need = job.local_devices
            if need > len(devices):
                clauses.append(
                    f"needs {_n(need, 'GPU')}, more than this server has "
                    f"({len(devices)}, --gpus); cancel it"
                )
            elif need > free:
                clauses.append(f"waiting for {_n(need, 'GPU')}: {free} free")
            if slots is not None and slots <= 0:
                clauses.append(f"{active} of {capacity} running (--max-concurrent-jobs)")
        if ahead:
            clauses.append(f"{_n(ahead, 'job')} ahead")
        out.places[job.job_id] = Place(first + ahead, ", ".join(clauses) or "next to start")
    return out
