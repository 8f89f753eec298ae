"""Which Unix account a job runs as.

A job runs code its submitter chose, so it must not run as the server's own account: that
account can read the server's token (``/proc/<pid>/environ``), its database and users
file, and signal it. The account of a job, in order:

1. the submitting user's ``unix_user`` in the users file (each person's jobs run as their
   own account, as with JupyterHub's local spawner or Slurm);
2. else the ``--job-user`` account (a dedicated unprivileged account);
3. else the server's own account: a *same-user job*. A script job is then refused unless
   the operator passed ``--allow-same-user-jobs``; the recipe (code the server ships)
   still runs.

Switching accounts needs root: a server running as root drops to the job's account (uid,
gid, no supplementary groups, umask 077) in the child, before it executes anything, and
never runs a job as root unless told ``--allow-same-user-jobs``.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Any

from dmuon_server.config import Settings
from dmuon_server.storage.accounts import Account, chown_to
from dmuon_server.users import Users

#: Modes of the data directory and its ``jobs`` folder when jobs run as other accounts:
#: they may pass through (to reach their own folder) but not list them.
_SHARED_DIR_MODE = 0o711
_PRIVATE_DIR_MODE = 0o700
#: The server's own files in the data directory (the database and its journals, the lock,
#: ``server.json``, the disk reserve): never readable by anyone else.
_STATE_FILES = (
    "dmuon-server.sqlite3",
    "dmuon-server.sqlite3-wal",
    "dmuon-server.sqlite3-shm",
    "dmuon-server.sqlite3-journal",
    "server.lock",
    "server.json",
    "space-reserve",
)


class IdentityError(ValueError):
    """An account the server cannot run jobs as; the message says what to do."""


def lookup_account(name: str, what: str) -> Account:
    """The account ``name`` (``what`` names where it was given, for the message).

    Raises :class:`IdentityError` for an unknown account and for root.
    """
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise IdentityError(
            f"{what}: there is no Unix account {name!r} on this host; create it (for example "
            f"useradd --system --no-create-home {name}) or fix the name"
        ) from None
    if pw.pw_uid == 0:
        raise IdentityError(f"{what}: {name!r} is root; jobs must run as an unprivileged account")
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir))


def server_account_name() -> str:
    """The name of the account the server runs as (its uid when it has no name)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


class JobIdentities:
    """The account of each job, from the settings and the users file.

    A user's ``unix_user`` is read from ``users`` at every launch, so a reloaded users file
    applies to the next attempt.
    """

    def __init__(self, settings: Settings, users: Users) -> None:
        """Look up ``--job-user`` (raises :class:`IdentityError`)."""
        self.settings = settings
        self.users = users
        self.job_user = (
            lookup_account(settings.job_user, "--job-user") if settings.job_user else None
        )

    @property
    def can_switch(self) -> bool:
        """Whether this server may run jobs as another account (it runs as root)."""
        return os.geteuid() == 0

    def account_for(self, user_name: str) -> Account | None:
        """The account the jobs of ``user_name`` run as; None: the server's own.

        Raises :class:`IdentityError` when the user's ``unix_user`` vanished from the host.
        """
        unix_user = self.users.unix_user_of(user_name) if user_name else None
        account = (
            lookup_account(unix_user, f"unix_user of {user_name!r}") if unix_user else self.job_user
        )
        if account is not None and not self.can_switch:
            raise IdentityError(
                f"jobs of {user_name or 'this server'} should run as the Unix account "
                f"{account.name}, and only a server running as root can switch to it"
            )
        return account

    def owner_uid(self, user_name: str) -> int:
        """The uid that owns the files of ``user_name``'s jobs."""
        try:
            account = self.account_for(user_name)
        except IdentityError:
            return -1  # matches no file: nothing of the job is served
        return account.uid if account is not None else os.geteuid()

    def refusal(self, user_name: str, *, script: bool) -> str | None:
        """Why ``user_name`` may not run a job (a ``script`` job or the recipe) on this
        server, or None: their account is unusable, or a script would run as the server's
        own account without ``--allow-same-user-jobs``."""
        try:
            account = self.account_for(user_name)
        except IdentityError as e:
            return str(e)
        if account is not None or not script or self.settings.allow_same_user_jobs:
            return None
        return (
            "this server would run the script as its own Unix account "
            f"({server_account_name()}), from where it could read the server's token and "
            "database; ask the operator to run the server as root with --job-user ACCOUNT "
            "(or a unix_user for you in the users file), or to accept that risk with "
            "--allow-same-user-jobs"
        )

    @property
    def shares_data_dir(self) -> bool:
        """Whether jobs run as accounts other than the server's, and so must be able to
        pass through the data directory to their folders."""
        return self.can_switch and (self.job_user is not None or bool(self.users.unix_users()))

    def secure_data_dir(self) -> None:
        """Give the data directory, its ``jobs`` folder and the server's files their modes:
        0711 folders when jobs run as other accounts (0700 otherwise), 0600 files.

        Raises :class:`IdentityError` when other accounts cannot reach the folder."""
        data_dir = self.settings.data_dir
        mode = _SHARED_DIR_MODE if self.shares_data_dir else _PRIVATE_DIR_MODE
        for folder in (data_dir, self.settings.jobs_dir):
            if folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) != mode:
                folder.chmod(mode)
        for name in _STATE_FILES:
            path = data_dir / name
            if path.is_file() and not path.is_symlink():
                path.chmod(0o600)
        if self.shares_data_dir:
            unreachable = closed_ancestor(data_dir)
            if unreachable is not None:
                raise IdentityError(
                    f"jobs run as other Unix accounts, which cannot reach the data directory "
                    f"{data_dir}: {unreachable} is not searchable by other users; chmod o+x "
                    "it, or pass a --data-dir outside it"
                )

    def prepare_job_dir(self, job_dir: Path, account: Account | None) -> None:
        """Create the job's folder (mode 0700) and give it to ``account``.

        Raises :class:`OSError` or :class:`IdentityError` (the data directory is out of the
        account's reach)."""
        if account is not None and self.can_switch:
            self.secure_data_dir()  # a reloaded users file may have added a unix_user
        job_dir.mkdir(mode=_PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        job_dir.chmod(_PRIVATE_DIR_MODE)
        chown_to(job_dir, account)

    def startup_problem(self) -> str | None:
        """Why the server must not start with these settings, or None."""
        unix_users = self.users.unix_users()
        for name in unix_users:
            try:
                lookup_account(name, "unix_user in the users file")
            except IdentityError as e:
                return str(e)
        wants_switch = self.job_user is not None or bool(unix_users)
        if wants_switch and not self.can_switch:
            return (
                "jobs can run as another Unix account (--job-user, unix_user) only when the "
                f"server runs as root, and it runs as {server_account_name()}; start it as "
                "root, or drop --job-user and unix_user (script jobs then need "
                "--allow-same-user-jobs)"
            )
        if wants_switch and self.can_switch:
            python = Path(self.settings.python)
            closed = closed_ancestor(python) or closed_ancestor(python.resolve())
            if closed is not None:
                return (
                    f"jobs run as other Unix accounts, which cannot reach the interpreter "
                    f"{self.settings.python}: {closed} is not searchable by other users; "
                    "chmod o+x it, or install the server where every account can read it"
                )
        if self.can_switch and self.job_user is None and not self.settings.allow_same_user_jobs:
            return (
                "the server runs as root and would run jobs as root: give --job-user ACCOUNT "
                "(a dedicated unprivileged account; users with a unix_user in the users file "
                "run as their own), or pass --allow-same-user-jobs to run them as root"
            )
        return None


def closed_ancestor(path: Path) -> Path | None:
    """The first folder on the way to ``path`` (itself excluded) that other users cannot
    pass through, or None."""
    for folder in reversed(path.parents):
        if not folder.stat().st_mode & stat.S_IXOTH:
            return folder
    return None


def drop_privileges(account: Account | None) -> dict[str, Any]:
    """``subprocess.Popen`` arguments that start a child as ``account`` (none for the
    server's own account): uid, gid, no supplementary groups, umask 077."""
    if account is None or os.geteuid() != 0:
        return {}
    return {"user": account.uid, "group": account.gid, "extra_groups": [], "umask": 0o077}


def account_env(account: Account | None, home: Path) -> dict[str, str]:
    """``HOME``, ``USER`` and ``LOGNAME`` of a job running as ``account`` (``home``: its
    home inside the job's view)."""
    if account is None:
        return {}
    return {"HOME": str(home), "USER": account.name, "LOGNAME": account.name}


def job_home(account: Account | None, job_dir: Path, *, sandboxed: bool) -> Path:
    """The ``HOME`` of a job running as ``account``: the account's home when it has one of
    its own and the job is not sandboxed, else the job's folder."""
    if account is None or sandboxed:
        return job_dir
    try:
        st = account.home.stat()
    except OSError:
        return job_dir
    return account.home if stat.S_ISDIR(st.st_mode) and st.st_uid == account.uid else job_dir
