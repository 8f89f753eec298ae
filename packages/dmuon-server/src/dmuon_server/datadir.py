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
