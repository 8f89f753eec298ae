"""The data directory: checks before the server starts, its lock, and ``server.json``.

One server per data directory: :class:`DataDirLock` holds an exclusive ``flock`` on
``<data-dir>/server.lock`` for the server's lifetime. The CLI takes it before it writes
anything else or binds its port, so a second server is refused without touching the
first one's files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

LOCK_FILE = "server.lock"
INFO_FILE = "server.json"
RESERVE_FILE = "space-reserve"
#: Below this much free space (besides the reserve) a disk counts as full.
FULL_BELOW_BYTES = 1 << 20


class StartupError(Exception):
    """A problem that keeps the server from starting; the message names the path."""


def _cause(e: OSError) -> str:
    return e.strerror or str(e)


def ensure_dir(path: Path, what: str) -> None:
    """Create ``path`` (and its parents) or say why it cannot be a folder."""
    if path.exists() and not path.is_dir():
        raise StartupError(
            f"the {what} {path} exists and is not a folder; move it away or pass another --data-dir"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StartupError(
            f"cannot create the {what} {path}: {_cause(e)}; pass a --data-dir you can write to"
        ) from None


def check_data_dir(data_dir: Path, jobs_dir: Path) -> None:
    """Check that the data directory is a writable folder and its ``jobs`` a folder."""
    ensure_dir(data_dir, "data directory")
    probe = data_dir / f".write-test.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise StartupError(
            f"cannot write to the data directory {data_dir}: {_cause(e)}; pass a --data-dir "
            "you can write to"
        ) from None
    ensure_dir(jobs_dir, "jobs folder")


class DataDirLock:
    """An exclusive lock on a data directory (POSIX ``flock``); re-acquiring is a no-op."""

    def __init__(self, data_dir: Path) -> None:
        """Lock ``data_dir`` once :meth:`acquire` is called."""
        self.data_dir = data_dir
        self.path = data_dir / LOCK_FILE
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`StartupError` naming the server that holds it."""
        if self._file is not None:
            return
        import fcntl

        ensure_dir(self.data_dir, "data directory")
        try:
            f = self.path.open("a+")  # never truncate a lock another server holds
        except OSError as e:
            raise StartupError(f"cannot open the lock file {self.path}: {_cause(e)}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise StartupError(
                f"another dmuon-server{who} is using the data directory {self.data_dir}; "
                "stop it or pass another --data-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        """Let the lock go (idempotent)."""
        if self._file is not None:
            self._file.close()  # closing the file releases the flock
            self._file = None


def write_server_info(data_dir: Path, info: dict[str, Any]) -> None:
    """Write ``<data-dir>/server.json`` atomically."""
    tmp = data_dir / f".{INFO_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, data_dir / INFO_FILE)


class SpaceReserve:
    """A file of ``size`` bytes in the data directory, given back when the disk fills.

    A job that fills the data directory's disk (checkpoints, logs) leaves the server's
    database nothing to write into, and the server could no longer record that the job
    ended. The supervisor holds this file while there is room, deletes it when a write of
    the database fails on a full disk (:meth:`release`), so that the next write can record
    the outcome, and takes the space again once there is twice as much free
    (:meth:`replenish`).
    """

    def __init__(self, data_dir: Path, size: int) -> None:
        """A reserve of ``size`` bytes at ``<data-dir>/space-reserve`` (none for 0)."""
        self.path = data_dir / RESERVE_FILE
        self.size = size

    @property
    def held(self) -> bool:
        """Whether the file is there, at its full size."""
        try:
            return self.path.stat().st_size >= self.size > 0
        except OSError:
            return False

    def replenish(self) -> bool:
        """Take the space (allocated, not a sparse file) when it is free twice over;
        whether the reserve is held afterwards."""
        if self.size <= 0:
            return False
        if self.held:
            return True
        try:
            if free_bytes(self.path.parent) < 2 * self.size:
                return False
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
        except OSError:
            self.path.unlink(missing_ok=True)
            return False
        return True

    def release(self) -> bool:
        """Give the space back; whether there was a reserve to give."""
        had = self.held
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            return False
        return had


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def disk_full(path: Path, reserve: SpaceReserve | None = None) -> bool:
    """Whether the file system of ``path`` is full: less than ``FULL_BELOW_BYTES`` free
    once a released ``reserve``'s bytes (on the same disk) are set apart."""
    try:
        free = free_bytes(path)
    except OSError:
        return False
    if reserve is not None and not reserve.held:
        free -= reserve.size
    return free < FULL_BELOW_BYTES
