"""Opening the files of a job's folder without trusting what the job put there.

A job owns its folder and may replace any file in it with a symbolic link (to the server's
database, say), a FIFO (to block the server) or a hard link. The server (often root) opens
files below a job's folder only through :func:`open_in`: every component is opened relative
to the one before with ``O_NOFOLLOW``, so no link is followed anywhere below the folder,
and only a regular file is returned. What the server serves to users must also pass
:func:`servable`: owned by the job's account and with a single link.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(relative: str | PurePosixPath) -> tuple[str, ...]:
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise FileNotFoundError(errno.ENOENT, "not a path inside the job's folder", str(relative))
    return parts


def open_in(root: Path, relative: str | PurePosixPath, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``root/relative``, following no link below ``root``.

    ``flags`` are ``os.open``'s (``O_CREAT`` creates with mode 0600). Raises
    :class:`OSError`: ``ELOOP``/``ENOTDIR`` for a link on the way, ``EINVAL`` for something
    other than a regular file (a FIFO is opened without blocking, then refused).
    """
    parts = _parts(relative)
    dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = next_fd
        fd = os.open(
            parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(relative))
    os.set_blocking(fd, True)
    return fd


def open_path_in(root: Path, path: Path, flags: int = os.O_RDONLY) -> int:
    """:func:`open_in` for an absolute ``path`` that must lie below ``root``."""
    try:
        relative = path.relative_to(root)
    except ValueError:
        raise FileNotFoundError(errno.ENOENT, "outside the job's folder", str(path)) from None
    return open_in(root, relative.as_posix(), flags)


def servable(st: os.stat_result, owner_uid: int) -> bool:
    """Whether a file with status ``st`` may be served as a job's artifact: a regular file
    owned by the job's account (``owner_uid``) with one link: never a hard link to a file of
    the server or of another account."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == owner_uid and st.st_nlink == 1
