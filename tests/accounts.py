"""A normal (non-root) account for tests that run something as a person would, not as
the root account of the tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: A normal account the docs' shell examples also run as (made if missing).
NORMAL_ACCOUNT = "dmuon-t-readme"


def normal_account() -> tuple[int, int] | None:
    """``(uid, gid)`` of `NORMAL_ACCOUNT`, made if missing; None unless the tests run as
    root (with ``useradd``)."""
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("useradd") is None:
        return None
    try:
        entry = pwd.getpwnam(NORMAL_ACCOUNT)
    except KeyError:
        # Another test worker may make it at the same time: then useradd fails, and the
        # account is there all the same.
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             NORMAL_ACCOUNT],
            capture_output=True,
        )  # fmt: skip
        entry = pwd.getpwnam(NORMAL_ACCOUNT)
    return entry.pw_uid, entry.pw_gid


@contextmanager
def folder_of(account: tuple[int, int], prefix: str) -> Iterator[Path]:
    """A new folder under /tmp owned by ``account`` (the tests' own folders are root's
    alone), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(folder, *account)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
