"""Finding and signalling the processes of a job.

"Every process of the job" is the runner, all its descendants, and every process carrying
``DMUON_SERVER_JOB=<id>`` in its environment: torchrun starts each worker in a session of
its own, so a process-group signal alone would miss them, and a worker orphaned by a killed
torchrun is no longer a descendant of anything the server knows. A recorded process is
recognised by pid *and* create time, so a reused pid is never mistaken for the job.
"""

from __future__ import annotations

import contextlib
import os
import signal

import psutil

from dmuon_server.config import JOB_ENV_MARKER
from dmuon_server.storage.records import JobRecord

#: Tolerance when comparing a process's create time with the recorded one.
_CREATE_TIME_TOLERANCE_S = 0.05


def verified_process(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The live (non-zombie) process ``pid`` if it is the one created at ``create_time``."""
    if pid is None or create_time is None:
        return None
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > _CREATE_TIME_TOLERANCE_S:
            return None
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def find_job_processes(job_id: str, root: psutil.Process | None = None) -> list[psutil.Process]:
    """Every live process of a job: ``root``, its descendants and env-marked processes."""
    found: dict[int, psutil.Process] = {}
    if root is not None:
        with contextlib.suppress(psutil.Error):
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid in found or p.pid == me:
            continue
        try:
            if p.environ().get(JOB_ENV_MARKER) == job_id:
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    alive = []
    for p in found.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def find_runner(job_id: str) -> psutil.Process | None:
    """The job's runner process (``dmuon_server.runner``), found by its marker."""
    for p in find_job_processes(job_id):
        if is_runner(p):
            return p
    return None


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each process, skipping those already gone."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def kill_and_reap(procs: list[psutil.Process], sig: int, timeout: float = 5.0) -> None:
    """Send ``sig`` to each process and wait (up to ``timeout``) until they are gone."""
    signal_all(procs, sig)
    psutil.wait_procs(procs, timeout=timeout)


def signal_job(job: JobRecord, root: psutil.Process | None, sig: int) -> int:
    """Signal every process of the job, then its process group.

    The ranks go first and torchrun (the runner, the group leader) last: a torchrun that
    is signalled while its ranks still live shuts them down itself, which takes it seconds;
    with the ranks already gone it exits in a fraction of one. The group is signalled
    only while its leader is verified to be the recorded process (pid and create time),
    so a reused pgid is never hit. Returns how many processes were signalled.
    """
    procs = find_job_processes(job.id, root)
    leader = [p for p in procs if root is not None and p.pid == root.pid]
    signal_all([p for p in procs if p not in leader], sig)
    signal_all(leader, sig)
    if root is not None and job.pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(job.pgid), sig)
    return len(procs)


def cmdline(p: psutil.Process) -> list[str]:
    """The command line of ``p`` (empty when it cannot be read)."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def is_runner(p: psutil.Process) -> bool:
    """Whether ``p`` is a job's runner (torchrun's launcher, :mod:`dmuon_server.runner`)."""
    return "dmuon_server.runner" in " ".join(cmdline(p))


def signal_ranks(job: JobRecord, root: psutil.Process | None, sig: int) -> int:
    """Signal the job's ranks (every process but the runner); the whole job when it has
    none yet (torchrun still starting them).

    The runner is spared on purpose: torchrun, signalled, signals its ranks once more, and
    the recipe takes a second SIGTERM as "stop now, without saving". Once the ranks have
    saved and exited, torchrun ends by itself. Returns how many processes were signalled.
    """
    procs = find_job_processes(job.id, root)
    ranks = [p for p in procs if not (root is not None and p.pid == root.pid) and not is_runner(p)]
    if not ranks:
        return signal_job(job, root, sig)
    signal_all(ranks, sig)
    return len(ranks)


#: Signals that ask a process to end; one that is pending on a stopped process waits for a
#: SIGCONT that may never come.
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _pending_signals(pid: int) -> int:
    """The signals pending on process ``pid`` (a bit mask, bit ``n - 1`` for signal ``n``),
    from ``/proc/<pid>/status``; 0 where that cannot be read."""
    mask = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("SigPnd", "ShdPnd"):
                    mask |= int(value.strip(), 16)
    except (OSError, ValueError):
        return 0
    return mask


def stopped_and_told_to_end(p: psutil.Process) -> bool:
    """Whether ``p`` is stopped (SIGSTOP, a debugger) with SIGTERM, SIGINT or SIGHUP
    pending: it was asked to end and cannot act on it until continued."""
    try:
        if p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return False
    except psutil.Error:
        return False
    pending = _pending_signals(p.pid)
    return any(pending & (1 << (int(s) - 1)) for s in _ENDING_SIGNALS)


def kill_stopped_ranks(root: psutil.Process) -> list[int]:
    """SIGKILL the ranks (children of the runner ``root``) that are stopped while told to
    end, and return their pids.

    When one rank fails, torchrun sends SIGTERM to the others and waits 30 s before its
    SIGKILL; a rank stopped with SIGSTOP (or hung in a stopped state) would hold the
    attempt that long. SIGKILL acts on a stopped process at once.
    """
    killed = []
    try:
        ranks = root.children()
    except psutil.Error:
        return []
    for p in ranks:
        if stopped_and_told_to_end(p):
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
                killed.append(p.pid)
    return killed
