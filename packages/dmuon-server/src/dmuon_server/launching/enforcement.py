"""Which kernel limits a local server holds for its jobs, and refusing to start without one
that was asked for.

A limit is *asked for* by a flag given on the command line (``--max-job-memory``,
``--max-job-pids``, ``--max-job-cpus``) or by the users file (``memory_gib``,
``disk_gib``). Memory and processes have defaults too; a default the machine cannot hold
is reported, not refused. A limit asked for that the machine cannot hold stops the
server at start-up (exit status 2) with what is missing and how to get it, unless the
operator passes ``--allow-unenforced-limits``; ``GET /v1/server`` and the dashboard then
say which limits are off. A users file reloaded on SIGHUP is held to the same rule: one
that asks for a limit the machine cannot hold is not loaded (`HeldLimits.recheck`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from dmuon_server.config import Settings
from dmuon_server.launching.cgroups import Cgroups
from dmuon_server.launching.volumes import UserVolumes
from dmuon_server.storage.datadir import StartupError
from dmuon_server.users import User

log = logging.getLogger(__name__)

#: The flags that ask for a kernel limit, by the limit they ask for.
LIMIT_FLAGS = {"memory": "--max-job-memory", "pids": "--max-job-pids", "cpus": "--max-job-cpus"}

#: How to get what is missing, by what holds the limit.
_HOW_CGROUPS = (
    "run the server as root, or give its account a cgroup v2 of its own with the memory, "
    "pids and cpu controllers delegated (for example: systemd-run --user --scope "
    "-p Delegate=yes dmuon-server ...)"
)
_HOW_VOLUMES = (
    "run the server as root with util-linux and e2fsprogs installed (losetup, mkfs.ext4, "
    "mount) and a free loop device"
)


@dataclass(frozen=True)
class LimitStatus:
    """One kind of limit on local jobs: who asked for it, and whether it is held."""

    #: ``memory``, ``pids``, ``cpus`` or ``disk``.
    name: str
    #: What asked for it: a flag, the users file (naming its users), or None for a
    #: server default nobody asked for.
    asked_by: str | None
    #: Whether the kernel holds it for every job.
    held: bool
    #: Why it is not held ("" when it is).
    why: str = ""


def _users_asking(users: Iterable[User], key: str) -> list[str]:
    return [u.name for u in users if getattr(u.limits, key) is not None]


def _asked_by(flag: str | None, users: list[str], key: str) -> str | None:
    parts = [flag] if flag else []
    if users:
        parts.append(f"{key} in the users file ({', '.join(users)})")
    return " and ".join(parts) or None


def limit_statuses(
    settings: Settings,
    users: Iterable[User],
    cgroups: Cgroups | None,
    cgroups_note: str,
    volumes_held: bool,
    volumes_note: str,
) -> tuple[LimitStatus, ...]:
    """The status of each kind of limit, given what the machine offers: job cgroups
    (``cgroups``, None where it offers none, and ``cgroups_note`` saying why) and disk
    volumes (``volumes_held``; ``volumes_note`` saying why not)."""
    users = list(users)
    asked = set(settings.limits_asked)
    statuses = []
    for name, key in (("memory", "memory_gib"), ("pids", None), ("cpus", None)):
        flag = LIMIT_FLAGS[name] if name in asked else None
        if name == "cpus" and settings.max_job_cpus is None:
            continue  # no CPU limit at all: nothing to hold
        by = _asked_by(flag, _users_asking(users, key) if key else [], key or "")
        if cgroups is None:
            statuses.append(LimitStatus(name, by, False, cgroups_note))
        elif name == "cpus" and "cpu" in cgroups.missing:
            statuses.append(LimitStatus(name, by, False, "the cgroup cpu controller is absent"))
        else:
            statuses.append(LimitStatus(name, by, True))
    disk_users = _users_asking(users, "disk_gib")
    if disk_users:
        by = _asked_by(None, disk_users, "disk_gib")
        statuses.append(LimitStatus("disk", by, volumes_held, "" if volumes_held else volumes_note))
    return tuple(statuses)


def refuse_unheld(statuses: Iterable[LimitStatus], allowed: bool) -> list[str]:
    """Raise :class:`StartupError` naming every limit asked for that is not held, what is
    missing and how to get it, unless ``allowed`` (``--allow-unenforced-limits``); the
    start-up warnings for those not held otherwise."""
    unheld = [s for s in statuses if not s.held]
    asked = [s for s in unheld if s.asked_by is not None]
    if asked and not allowed:
        lines = [f"{s.name} (asked by {s.asked_by}): {s.why}" for s in asked]
        how = {_HOW_VOLUMES if s.name == "disk" else _HOW_CGROUPS for s in asked}
        raise StartupError(
            "limits were asked for that this machine cannot hold: "
            + "; ".join(lines)
            + ". To hold them: "
            + "; ".join(sorted(how))
            + ". To run without them, pass --allow-unenforced-limits (GET /v1/server and "
            "the dashboard then say which limits are off)"
        )
    warnings = [
        f"WARNING: no {s.name} limit on jobs"
        + (f" although {s.asked_by} asks for one" if s.asked_by else " (a default)")
        + f": {s.why}"
        for s in unheld
    ]
    if any(s.name != "disk" for s in unheld):
        warnings.append(
            "WARNING: without a cgroup a job may use all memory and processes, and a "
            "process it detaches may outlive it"
        )
    return warnings


@dataclass
class HeldLimits:
    """What a local server found it can hold (job cgroups, disk volumes, each with the
    line saying why or why not) and the status of each limit for the users it serves."""

    cgroups: Cgroups | None
    cgroups_note: str
    volumes: UserVolumes | None
    volumes_note: str
    statuses: tuple[LimitStatus, ...] = ()

    def hold(self, settings: Settings, users: Iterable[User]) -> None:
        """Serve ``users``: take their limits' statuses and log those not held, or raise
        :class:`StartupError` for a limit they ask for that this machine cannot hold
        (:func:`refuse_unheld`), the statuses then staying as they were."""
        statuses = limit_statuses(
            settings,
            users,
            self.cgroups,
            self.cgroups_note,
            self.volumes is not None,
            self.volumes_note,
        )
        warnings = refuse_unheld(statuses, settings.allow_unenforced_limits)
        self.statuses = statuses
        for line in warnings:
            log.warning("%s", line)

    def recheck(self, settings: Settings, users: Iterable[User]) -> str | None:
        """For a reload of the users file: `hold` ``users``, or say why they cannot be
        served (nothing changes then)."""
        try:
            self.hold(settings, users)
        except StartupError as error:
            return str(error)
        return None


def hold_limits(settings: Settings, users: Iterable[User]) -> HeldLimits:
    """Find what this machine offers a local server (job cgroups, disk volumes), refuse
    to start without a limit asked for that it cannot hold (`HeldLimits.hold`), and log
    what holds and what does not."""
    cgroups, cgroups_note = Cgroups.detect()
    volumes, volumes_note = UserVolumes.detect(settings.data_dir, settings.jobs_dir)
    held = HeldLimits(cgroups, cgroups_note, volumes, volumes_note)
    held.hold(settings, users)
    for found, note in ((cgroups, cgroups_note), (volumes, volumes_note)):
        if found is not None:
            log.info("%s", note)
    return held
