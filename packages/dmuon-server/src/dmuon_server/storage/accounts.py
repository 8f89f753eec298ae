"""Who owns a job's files: the Unix account a job runs as, and giving a file to it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Account:
    """A Unix account jobs run as."""

    name: str
    uid: int
    gid: int
    home: Path


def chown_to(path: Path | int, account: Account | None) -> None:
    """Give ``path`` (or an open descriptor) to ``account``; nothing for the server's own
    account. Links are never followed."""
    if account is None or os.geteuid() != 0:
        return
    if isinstance(path, int):
        os.fchown(path, account.uid, account.gid)
    else:
        os.chown(path, account.uid, account.gid, follow_symlinks=False)
