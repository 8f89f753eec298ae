"""Kernel limits for local jobs: each attempt of a job in a control group of its own.

A job's processes (its runner, torchrun, the ranks, and anything they start, whatever
session or environment it gives itself) are placed in one cgroup before the job runs
anything: the child writes itself into the cgroup between ``fork`` and ``exec``, through
descriptors the server opened. The cgroup caps the job's memory (``--max-job-memory``: the
kernel stops the job that goes beyond, and the attempt says so), its number of processes
(``--max-job-pids``) and its CPU time (``--max-job-cpus``). When the attempt ends, or a
cancel's grace period is over, every process left in the cgroup is killed and the cgroup
removed: nothing outlives its job, and its GPUs are given back only then.

Where: the server's own cgroup, as ``/proc/self/cgroup`` names it, under a ``dmuon-jobs``
folder. cgroup v2 is used where the server's cgroup offers the memory and pids controllers
(the server then moves itself into a leaf ``server`` cgroup beside its jobs, as the "no
internal processes" rule of v2 requires); cgroup v1 where the memory and pids hierarchies
are mounted instead (cpu too when mounted). What the machine lacks is said at start-up,
and jobs then run without that limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dmuon_server.config import format_gib

#: The folder under the server's cgroup that holds one cgroup per job attempt.
JOBS_FOLDER = "dmuon-jobs"
#: The controllers a job's limits need (cpu is used where present).
REQUIRED = ("memory", "pids")
_PERIOD_US = 100_000
_KILL_ROUNDS = 200


class CgroupError(OSError):
    """A job's cgroup could not be made or joined."""


@dataclass(frozen=True)
class JobLimits:
    """What the kernel holds one job to."""

    memory_bytes: int
    pids: int
    cpus: float | None = None
    #: Which setting ``memory_bytes`` comes from (said when the kernel stops the job).
    memory_source: str = "--max-job-memory"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _own_cgroups() -> dict[str, str]:
    """``{controller or "" for v2: path}`` from ``/proc/self/cgroup``."""
    out: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path
    return out


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """``(mount point, root, fstype, super options)`` of every cgroup mount."""
    out = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], fields[3], tail[0], set(tail[2].split(","))))
    return out


def _inside(mount: str, root: str, path: str) -> Path:
    """Where the cgroup ``path`` (as ``/proc/self/cgroup`` names it) lies under a mount of
    its hierarchy whose root is ``root``."""
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root) :]
    relative = path.strip("/")
    return Path(mount) / relative if relative else Path(mount)


def limit_hit(cgroup: JobCgroup, limits: JobLimits) -> str | None:
    """Why the kernel stopped the job, when one of its limits did; None otherwise."""
    if cgroup.out_of_memory():
        return (
            f"the job went beyond its memory limit of {format_gib(limits.memory_bytes)} "
            f"({limits.memory_source}), and the kernel killed it"
        )
    if cgroup.out_of_pids():
        return (
            f"the job tried to run more than {limits.pids} processes at once "
            "(--max-job-pids), and the kernel refused"
        )
    return None


@dataclass
class JobCgroup:
    """The cgroup(s) of one job attempt: one folder (v2) or one per controller (v1)."""

    folders: dict[str, Path]
    memory_key: str
    pids_key: str

    def enroller(self) -> tuple[list[int], Callable[[], None]]:
        """Descriptors of the cgroups' process lists, opened here (where writing is
        allowed), and the function that, run in the child between fork and exec (after
        it dropped its privileges), writes the child into them. Close the descriptors
        once the child started."""
        fds = [os.open(folder / "cgroup.procs", os.O_WRONLY) for folder in self.folders.values()]

        def enroll() -> None:
            for fd in fds:
                os.write(fd, b"0")  # 0: the writing process itself

        return fds, enroll

    def processes(self) -> set[int]:
        """The pids in the job's cgroup(s)."""
        pids: set[int] = set()
        for folder in self.folders.values():
            pids |= {int(p) for p in _read(folder / "cgroup.procs").split()}
        return pids

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to every process of the cgroup, again until none is left (for
        SIGKILL); returns how many were signalled."""
        signalled: set[int] = set()
        for _ in range(_KILL_ROUNDS):
            left = self.processes()
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            signalled |= left
            if sig != signal.SIGKILL:
                break
            time.sleep(0.02)
        return len(signalled)

    def _events(self, key: str, file: str, name: str) -> int:
        text = _read(self.folders[key] / file)
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == name:
                return int(parts[1])
        return 0

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the job for its memory limit."""
        if "" in self.folders:
            return self._events("", "memory.events", "oom_kill") > 0
        return self._events("memory", "memory.oom_control", "oom_kill") > 0

    def out_of_pids(self) -> bool:
        """Whether the job tried to start a process beyond its limit."""
        return self._events(self.pids_key, "pids.events", "max") > 0

    def remove(self) -> None:
        """Remove the (empty) cgroup folders."""
        for folder in self.folders.values():
            with contextlib.suppress(OSError):
                folder.rmdir()


def _probe(parents: dict[str, Path]) -> OSError | None:
    """Why this server cannot make a job cgroup in ``parents``, or None: one is made and
    removed in each."""
    name = f"probe-{os.getpid()}"
    try:
        for parent in parents.values():
            (parent / name).mkdir(exist_ok=True)
            (parent / name).rmdir()
    except OSError as e:
        return e
    return None


@dataclass
class Cgroups:
    """Where job cgroups are made on this machine, and how."""

    version: int
    #: ``{controller: folder holding the job cgroups}``; v2: ``{"": folder}``.
    parents: dict[str, Path]
    missing: list[str] = field(default_factory=list)

    @classmethod
    def detect(cls) -> tuple[Cgroups | None, str]:
        """The job cgroups of this machine and what the server says of them at start-up,
        or None and why this machine offers none."""
        own = _own_cgroups()
        mounts = _mounts()
        v2 = next((m for m in mounts if m[2] == "cgroup2"), None)
        if v2 is not None and "" in own:
            found = cls._v2(_inside(v2[0], v2[1], own[""]))
            if found is not None and _probe(found.parents) is None:
                return found, found.describe()
        parents: dict[str, Path] = {}
        for controller in (*REQUIRED, "cpu"):
            mount = next((m for m in mounts if m[2] == "cgroup" and controller in m[3]), None)
            if mount is not None and controller in own:
                parents[controller] = _inside(mount[0], mount[1], own[controller]) / JOBS_FOLDER
        absent = [c for c in REQUIRED if c not in parents]
        if absent:
            return None, (
                f"this machine offers the server no cgroup controller for {', '.join(absent)} "
                "(cgroup v2 delegated to the server's cgroup, or cgroup v1 mounted)"
            )
        try:
            for parent in parents.values():
                parent.mkdir(exist_ok=True)
        except OSError as e:
            failed: OSError | None = e
        else:  # the folder may be an earlier root server's, this server unable to write it
            failed = _probe(parents)
        if failed is not None:
            return None, f"the server cannot create {failed.filename} ({failed.strerror})"
        found = cls(1, parents, missing=[] if "cpu" in parents else ["cpu"])
        return found, found.describe()

    @classmethod
    def _v2(cls, own: Path) -> Cgroups | None:
        available = set(_read(own / "cgroup.controllers").split())
        if not set(REQUIRED) <= available:
            return None
        wanted = [c for c in (*REQUIRED, "cpu") if c in available]
        try:
            # v2 allows controllers for children only in a cgroup without processes: the
            # server moves into a leaf of its own first.
            server = own / "server"
            server.mkdir(exist_ok=True)
            _write(server / "cgroup.procs", "0")
            _write(own / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            jobs = own / JOBS_FOLDER
            jobs.mkdir(exist_ok=True)
            _write(jobs / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        except OSError:
            return None
        return cls(2, {"": jobs}, missing=[c for c in ("cpu",) if c not in wanted])

    def describe(self) -> str:
        """What the server says at start-up."""
        where = ", ".join(str(p) for p in self.parents.values())
        lacking = f"; no {', '.join(self.missing)} limit here" if self.missing else ""
        return f"each job runs in a cgroup v{self.version} of its own under {where}{lacking}"

    def create(self, name: str, limits: JobLimits) -> JobCgroup:
        """A new cgroup ``name`` holding ``limits`` (raises :class:`CgroupError`)."""
        folders = {key: parent / name for key, parent in self.parents.items()}
        try:
            for folder in folders.values():
                folder.mkdir(exist_ok=True)
            if self.version == 2:
                folder = folders[""]
                _write(folder / "memory.max", str(limits.memory_bytes))
                with contextlib.suppress(FileNotFoundError):
                    _write(folder / "memory.swap.max", "0")
                _write(folder / "pids.max", str(limits.pids))
                if limits.cpus is not None and (folder / "cpu.max").exists():
                    _write(folder / "cpu.max", f"{int(limits.cpus * _PERIOD_US)} {_PERIOD_US}")
            else:
                memory = folders["memory"]
                _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
                with contextlib.suppress(OSError):  # swap accounting may be off
                    _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
                _write(folders["pids"] / "pids.max", str(limits.pids))
                if limits.cpus is not None and "cpu" in folders:
                    _write(folders["cpu"] / "cpu.cfs_period_us", str(_PERIOD_US))
                    _write(folders["cpu"] / "cpu.cfs_quota_us", str(int(limits.cpus * _PERIOD_US)))
        except OSError as e:
            raise CgroupError(
                e.errno, f"cannot set up the job's cgroup: {e.strerror}", e.filename
            ) from e
        key = "" if self.version == 2 else "memory"
        return JobCgroup(folders, key, "" if self.version == 2 else "pids")

    def existing(self, name: str) -> JobCgroup | None:
        """The cgroup ``name`` made by an earlier server, if it is still there."""
        folders = {key: parent / name for key, parent in self.parents.items()}
        if not all(f.is_dir() for f in folders.values()):
            return None
        key = "" if self.version == 2 else "memory"
        return JobCgroup(folders, key, "" if self.version == 2 else "pids")
