"""Users: who a bearer token belongs to, from ``--users-file`` and ``--token``.

The users file holds SHA-256 hashes of tokens, never tokens::

    {"users": [{"name": "ada", "token_sha256": "9f86d0...", "admin": false,
                "unix_user": "ada", "limits": {"running_jobs": 2}}, ...],
     "default_limits": {"queued_jobs": 20, "running_jobs": 1, "gpus": 4,
                        "max_priority": 0}}

(``printf %s "$TOKEN" | sha256sum`` gives the hash; ``unix_user``, optional, is the Unix
account the user's jobs run as, see :mod:`dmuon_server.launching.identity`;
``host_network: true``, optional, lets the user's sandboxed jobs use the host's network
instead of a loopback-only one of their own). ``limits`` (a user's
own) or ``default_limits`` (everyone else but admins) bound what a user may hold:
``queued_jobs`` waiting at once and ``max_priority`` (checked when a job is submitted),
``running_jobs`` and ``gpus`` at once (the queue skips the user's next job until one
ends), ``disk_gib``, the space their job folders may take on the data directory (see
:mod:`dmuon_server.launching.volumes`), and ``memory_gib``, the memory one of their jobs
may use (see :meth:`Limits.job_memory`); a limit left out is no limit (see :class:`Limits`).
``slurm_accounts`` lists the Slurm accounts a user's jobs may charge (``account``; admins
may charge any).

It must not be readable or writable by other users (``chmod 600`` or ``640``): whoever
can write it can make themselves admin. It is read at start (a bad file stops the server)
and again on SIGHUP (a bad file then keeps the users loaded before, and says why in the
log). ``--token`` is one more user, the admin called ``admin``. A user sees and acts on
their own jobs only; an admin on every job.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("dmuon_server.users")

#: What a user name may be (it is shown, stored with every job, and used in filters).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
#: The user ``--token`` stands for.
TOKEN_USER = "admin"
_HASH = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_KEYS = {
    "name",
    "token_sha256",
    "admin",
    "unix_user",
    "limits",
    "slurm_accounts",
    "host_network",
}
#: What a Slurm account name may be (as the job spec's ``account``).
_SLURM_ACCOUNT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_LIMIT_KEYS = ("queued_jobs", "running_jobs", "gpus", "max_priority", "disk_gib", "memory_gib")
#: Limits given in GiB, as numbers (the others are integers).
_GIB_KEYS = ("disk_gib", "memory_gib")
#: The priorities a job may have (the job spec's bounds).
PRIORITY_RANGE = (-1000, 1000)
#: What a Unix account name may be (the portable set ``useradd`` accepts).
_UNIX_NAME = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}\$?$")


class UsersFileError(ValueError):
    """A users file the server cannot use; the message names the file and the entry."""


@dataclass(frozen=True)
class Limits:
    """What one user may hold at once (``None``: no limit)."""

    #: Jobs waiting in the queue; a submission beyond it is refused with 429.
    queued_jobs: int | None = None
    #: Jobs starting or running; the queue passes over the user's next job until one ends.
    running_jobs: int | None = None
    #: GPUs the user's active jobs hold together; likewise.
    gpus: int | None = None
    #: The highest ``priority`` the user may give a job; a higher one is refused with 403.
    max_priority: int | None = None
    #: GiB of the data directory's disk the user's job folders may hold together, set
    #: aside for the user (see :mod:`dmuon_server.launching.volumes`).
    disk_gib: float | None = None
    #: GiB one of the user's jobs may use (all its ranks), when below the server's
    #: ``--max-job-memory``: checked against the job's estimate at submission, and the
    #: kernel's limit of its cgroup.
    memory_gib: float | None = None

    def job_memory(self, server_bytes: int) -> tuple[int, str]:
        """The memory one of the user's jobs may use, in bytes, and which limit that is
        (``server_bytes``: the server's ``--max-job-memory``)."""
        if self.memory_gib is not None and self.memory_gib * 2**30 < server_bytes:
            return int(self.memory_gib * 2**30), "memory_gib in the users file"
        return server_bytes, "--max-job-memory"


def _limits(value: object, where: str) -> Limits:
    if not isinstance(value, dict) or set(value) - set(_LIMIT_KEYS):
        raise UsersFileError(
            f"{where}: limits may give {', '.join(_LIMIT_KEYS)}, as integers (the GiB ones "
            "as numbers)"
        )
    for key, number in value.items():
        if key in _GIB_KEYS:
            if (
                not isinstance(number, int | float)
                or isinstance(number, bool)
                or not 0.01 <= number <= 1_000_000
            ):
                raise UsersFileError(f"{where}: limits.{key} must be a number from 0.01 to 1000000")
            continue
        low = PRIORITY_RANGE[0] if key == "max_priority" else 0
        high = PRIORITY_RANGE[1] if key == "max_priority" else 1_000_000
        if not isinstance(number, int) or isinstance(number, bool) or not low <= number <= high:
            raise UsersFileError(f"{where}: limits.{key} must be an integer from {low} to {high}")
    return Limits(**value)


@dataclass(frozen=True)
class User:
    """Someone the server knows by a token."""

    name: str
    admin: bool = False
    #: The Unix account this user's jobs run as (None: the server's ``--job-user``).
    unix_user: str | None = None
    #: What the user may hold at once.
    limits: Limits = field(default_factory=Limits)
    #: The Slurm accounts the user's jobs may charge (``account``); empty: none but the
    #: server's default. Admins may charge any.
    slurm_accounts: tuple[str, ...] = ()
    #: Whether the user's local jobs keep the host's network in the sandbox (to reach a
    #: tracking server, say) instead of a loopback-only network of their own.
    host_network: bool = False


#: Who a request comes from on a server without tokens: nobody in particular, allowed all.
ANONYMOUS = User(name="", admin=True)


def token_hash(token: str) -> str:
    """The SHA-256 of a token, in hexadecimal (what the users file holds)."""
    return hashlib.sha256(token.encode()).hexdigest()


def read_users_file(path: Path) -> list[tuple[User, str]]:
    """The users of ``path`` with their token hashes; raises :class:`UsersFileError`."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsersFileError(f"cannot read the users file {path}: {e}") from None
    if mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_IROTH):
        raise UsersFileError(
            f"the users file {path} is readable or writable by other users (mode "
            f"{stat.S_IMODE(mode):o}); chmod 600 it"
        )
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise UsersFileError(f"the users file {path} is not JSON: {e}") from None
    entries = doc.get("users") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or set(doc) - {"users", "default_limits"}:
        raise UsersFileError(
            f'the users file {path} must be {{"users": [...]}}, with "default_limits" optionally'
        )
    defaults = _limits(doc.get("default_limits", {}), f"default_limits of {path}")
    out: list[tuple[User, str]] = []
    names: set[str] = set()
    hashes: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"users[{i}] of {path}"
        if not isinstance(entry, dict) or set(entry) - _ENTRY_KEYS:
            raise UsersFileError(
                f"{where}: give name, token_sha256 and optionally admin, unix_user, limits, "
                "slurm_accounts and host_network"
            )
        name, digest, admin = (
            entry.get("name"),
            entry.get("token_sha256"),
            entry.get("admin", False),
        )
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise UsersFileError(
                f"{where}: name {name!r} must be 1-64 letters, digits, '_', '.', '@' or '-'"
            )
        if not isinstance(digest, str) or not _HASH.match(digest):
            raise UsersFileError(
                f"{where}: token_sha256 must be 64 lower-case hex digits (printf %s TOKEN | "
                "sha256sum), never the token itself"
            )
        if not isinstance(admin, bool):
            raise UsersFileError(f"{where}: admin must be true or false")
        unix_user = entry.get("unix_user")
        if unix_user is not None and (
            not isinstance(unix_user, str) or not _UNIX_NAME.match(unix_user)
        ):
            raise UsersFileError(f"{where}: unix_user {unix_user!r} is not a Unix account name")
        if name in names:
            raise UsersFileError(f"{where}: the name {name!r} is given twice")
        if digest in hashes:
            raise UsersFileError(f"{where}: two users have the same token")
        names.add(name)
        hashes.add(digest)
        if "limits" in entry:
            limits = _limits(entry["limits"], where)
        else:
            limits = Limits() if admin else defaults
        accounts = entry.get("slurm_accounts", [])
        if not isinstance(accounts, list) or not all(
            isinstance(a, str) and _SLURM_ACCOUNT.match(a) for a in accounts
        ):
            raise UsersFileError(f"{where}: slurm_accounts must be a list of Slurm account names")
        host_network = entry.get("host_network", False)
        if not isinstance(host_network, bool):
            raise UsersFileError(f"{where}: host_network must be true or false")
        user = User(name, admin, unix_user, limits, tuple(accounts), host_network)
        out.append((user, digest))
    return out


class Users:
    """The users a server authenticates (thread-safe: SIGHUP reloads while requests run)."""

    def __init__(self, path: Path | None = None, token: str | None = None) -> None:
        """Load ``path`` (raises :class:`UsersFileError`) and add ``token``'s admin."""
        self.path = path
        self._token_entry = (User(TOKEN_USER, admin=True), token_hash(token)) if token else None
        self._lock = threading.Lock()
        self._entries = self._load()
        self._generation = 0
        self._reload_check: Callable[[list[User]], str | None] | None = None

    def check_reloads_with(self, check: Callable[[list[User]], str | None]) -> None:
        """Have every reload ask ``check(users)`` first: a message refuses the new users
        (the ones loaded before stay), as a bad file does; None accepts them."""
        self._reload_check = check

    @property
    def enabled(self) -> bool:
        """Whether requests must carry a token: a users file or ``--token`` is configured.

        An empty users file keeps authentication on, with nobody to let in (until a reload
        adds someone): it fails closed."""
        return self.path is not None or self._token_entry is not None

    @property
    def generation(self) -> int:
        """How many times the users were reloaded (a stream re-checks its token then)."""
        return self._generation

    def _load(self) -> list[tuple[User, str]]:
        entries = read_users_file(self.path) if self.path is not None else []
        if self._token_entry is not None:
            if any(u.name == TOKEN_USER for u, _ in entries):
                raise UsersFileError(
                    f"the users file {self.path} has a user called {TOKEN_USER!r}, the name "
                    "--token's user has; rename it, or drop --token"
                )
            entries.append(self._token_entry)
        return entries

    def reload(self) -> str | None:
        """Read the users file again; on a problem keep the users loaded before and return
        the message (also logged)."""
        try:
            entries = self._load()
        except UsersFileError as e:
            log.error("users not reloaded, the previous ones stay: %s", e)
            return str(e)
        if self._reload_check is not None:
            problem = self._reload_check([user for user, _ in entries])
            if problem is not None:
                log.error("users not reloaded, the previous ones stay: %s", problem)
                return problem
        with self._lock:
            self._entries = entries
            self._generation += 1
        log.info("reloaded %d user(s) from %s", len(entries), self.path)
        return None

    def authenticate(self, token: str) -> User | None:
        """The user ``token`` belongs to, or None. Every hash is compared (in constant time),
        so the time taken does not tell which users exist."""
        digest = token_hash(token).encode()
        found = None
        with self._lock:
            entries = list(self._entries)
        for user, expected in entries:
            if hmac.compare_digest(digest, expected.encode()):
                found = user
        return found

    def watch(self, token: str | None, user: User) -> Callable[[], bool]:
        """A check that ``token`` still belongs to ``user`` (same name and rights), for a
        long request such as an event stream: it hashes again only after a reload."""
        if not self.enabled:
            return lambda: True
        seen = self.generation
        valid = True

        def still_valid() -> bool:
            nonlocal seen, valid
            if valid and self.generation != seen:
                seen = self.generation
                valid = token is not None and self.authenticate(token) == user
            return valid

        return still_valid

    def unix_user_of(self, name: str) -> str | None:
        """The ``unix_user`` of the user called ``name`` (None: none given, or no such
        user)."""
        with self._lock:
            return next((u.unix_user for u, _ in self._entries if u.name == name), None)

    def host_network_of(self, name: str) -> bool:
        """Whether the jobs of the user called ``name`` keep the host's network (its
        ``host_network`` in the users file; False for an unknown or anonymous user)."""
        with self._lock:
            return next((u.host_network for u, _ in self._entries if u.name == name), False)

    def limits_of(self, name: str | None) -> Limits:
        """The limits of the user called ``name`` (none for an unknown or anonymous one)."""
        with self._lock:
            return next((u.limits for u, _ in self._entries if u.name == name), Limits())

    def may_charge(self, name: str | None, account: str) -> bool:
        """Whether the user called ``name`` may charge the Slurm ``account``: an admin, a
        user whose ``slurm_accounts`` lists it, or anyone on a server without users."""
        if not self.enabled:
            return True
        with self._lock:
            user = next((u for u, _ in self._entries if u.name == name), None)
        return user is not None and (user.admin or account in user.slurm_accounts)

    def unix_users(self) -> list[str]:
        """Every ``unix_user`` the file names."""
        with self._lock:
            return [u.unix_user for u, _ in self._entries if u.unix_user]

    def all(self) -> list[User]:
        """Every user, in the file's order (``--token``'s admin last)."""
        with self._lock:
            return [u for u, _ in self._entries]
