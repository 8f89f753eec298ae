"""Bearer-token authentication: the middleware (who a request comes from), checks of
a ``--token`` itself, the token a server makes for itself, and how a token leaves the
server's environment at start-up. Users and their token hashes are
:mod:`dmuon_server.users`."""

from __future__ import annotations

import math
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from dmuon_server.http.errors import ERROR_TEXT, problem_response
from dmuon_server.users import Users


class TokenError(ValueError):
    """A token no client could send (empty, whitespace, control characters)."""


def check_token(token: str, source: str) -> str:
    """Return ``token`` if a client can send it in an ``Authorization`` header.

    A bearer token must be visible ASCII without spaces (RFC 6750 ``b64token`` and then
    some); anything else would be accepted at start and then fail every request.
    ``source`` names where the token came from, for the message.
    """
    if not token.strip():
        raise TokenError(f"the token from {source} is empty or only whitespace; set a real one")
    bad = sorted({c for c in token if not "\x21" <= c <= "\x7e"})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        raise TokenError(
            f"the token from {source} contains {shown}; a bearer token must be visible "
            "ASCII without spaces or line breaks (check for a trailing newline)"
        )
    return token


def read_token_file(path: Path) -> str:
    """Read a token file: its content without one trailing line break, then checked."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"cannot read the token file {path}: {e}") from None
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return check_token(text, f"the file {path}")


#: The file in the data directory holding the token a server generates for itself.
GENERATED_TOKEN_FILE = "token"


def generated_token(data_dir: Path) -> tuple[str, Path, bool]:
    """The token of a server started without ``--token``, ``--token-file`` or
    ``--users-file``: ``(token, file, created)``.

    It is kept in ``<data_dir>/token`` (mode 600, the server's account's alone) and made
    the first time (32 random bytes, URL-safe base64) in the existing folder ``data_dir``,
    so clients keep working across
    restarts; deleting the file makes a new one. A file that others may read, or that
    belongs to another account, is refused (a :class:`TokenError` saying what to do).
    """
    path = data_dir / GENERATED_TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise TokenError(
                f"the token file {path} is not a regular file of this account; remove it"
            ) from None
        if info.st_mode & 0o077:
            raise TokenError(
                f"the token file {path} may be read by other accounts (mode "
                f"{stat.S_IMODE(info.st_mode):o}); remove it (a new token is made) or chmod 600"
            ) from None
        return read_token_file(path), path, False
    except OSError as e:
        raise TokenError(f"cannot create the token file {path}: {e.strerror or e}") from None
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path, True


def _without_token_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--token VALUE`` / ``--token=VALUE``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--token":
            skip = True
        elif not a.startswith("--token="):
            out.append(a)
    return out


def secret_names(*names: str | Iterable[str]) -> list[str]:
    """The secret variables among ``names`` (strings or lists of them) present in this
    process's environment."""
    flat = [n for group in names for n in ([group] if isinstance(group, str) else group)]
    return [n for n in flat if n in os.environ]


def exec_without_secrets(argv: list[str], token: str | None, secrets: list[str]) -> None:
    """Execute this server again without ``secrets`` in its environment nor the token on
    its command line; the token travels through a pipe (it fits in the pipe's buffer)."""
    env = {k: v for k, v in os.environ.items() if k not in secrets}
    args = _without_token_flag(argv)
    if token is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, token.encode())
        os.close(write_end)
        os.set_inheritable(read_end, True)
        args += ["--token-fd", str(read_end)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "dmuon_server", *args], env)


class FailureThrottle:
    """How many failed authentications each client may make: a burst of ``burst``, then
    one per ``1 / per_second`` seconds (a token bucket per client address).

    Tokens are 32 random bytes, so guessing is hopeless at any rate; the throttle bounds
    the work and the log a client's failures cost. A right token is never throttled: a
    person behind the same address (a shared NAT, loopback) is not locked out by another.
    """

    #: Clients remembered at most; past it, those whose bucket has refilled are forgotten.
    MAX_CLIENTS = 10_000

    def __init__(
        self,
        burst: int = 20,
        per_second: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``burst`` failures at once, then ``per_second``."""
        self.burst = burst
        self.per_second = per_second
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client: (tokens, at)

    def _tokens(self, client: str, now: float) -> float:
        tokens, at = self._buckets.get(client, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.per_second)

    def retry_after(self, client: str) -> int | None:
        """Seconds ``client`` must wait before its next failure is answered 401, or None
        when it may fail now."""
        tokens = self._tokens(client, self.clock())
        if tokens >= 1:
            return None
        return max(1, math.ceil((1 - tokens) / self.per_second))

    def failed(self, client: str) -> None:
        """Count one failed authentication of ``client``."""
        now = self.clock()
        if len(self._buckets) >= self.MAX_CLIENTS:
            self._buckets = {
                c: (t, at) for c, (t, at) in self._buckets.items()
                if self._tokens(c, now) < self.burst
            }  # fmt: skip
            while len(self._buckets) >= self.MAX_CLIENTS:
                self._buckets.pop(next(iter(self._buckets)))
        self._buckets[client] = (max(0.0, self._tokens(client, now) - 1), now)


class BearerAuthMiddleware:
    """Requires ``Authorization: Bearer <token>`` of a known user everywhere but
    ``/healthz``, and tells the routes who it is (``request.state.user``).

    Tokens are compared as SHA-256 hashes, in constant time, against every user
    (:meth:`dmuon_server.users.Users.authenticate`).
    """

    def __init__(self, app: ASGIApp, users: Users, throttle: FailureThrottle | None = None) -> None:
        """Wrap ``app``; failures are throttled per client by ``throttle``."""
        self.app = app
        self.users = users
        self.throttle = throttle or FailureThrottle()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Let authorised requests (and health checks) through, answer 401 otherwise, or
        429 with ``Retry-After`` to a client past its failures (see :class:`FailureThrottle`)."""
        if scope["type"] != "http" or scope.get("path") == "/healthz":
            await self.app(scope, receive, send)
            return
        auth = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value
                break
        scheme, _, credentials = auth.partition(b" ")
        user = None
        if scheme.lower() == b"bearer":
            user = self.users.authenticate(credentials.strip().decode("latin-1"))
        if user is not None:
            state = scope.setdefault("state", {})
            state["user"] = user
            # Long requests (event streams) check it again after a reload of the users.
            state["token"] = credentials.strip().decode("latin-1")
            await self.app(scope, receive, send)
            return
        client = (scope.get("client") or ("?", 0))[0]
        wait = self.throttle.retry_after(client)
        if wait is not None:
            response = problem_response(
                429,
                "Too many failed authentications",
                f"this address sent too many requests without a known token; wait {wait} s, "
                "then send your own token",
                kind="auth-throttled",
                headers={"Retry-After": str(wait)},
            )
            await response(scope, receive, send)
            return
        self.throttle.failed(client)
        detail = (
            "send the header 'Authorization: Bearer <token>' with your token"
            if not auth
            else "the bearer token is not one this server knows; use your own token"
        )
        response = problem_response(
            401,
            ERROR_TEXT[401],
            detail,
            kind="unauthorized",
            headers={
                "WWW-Authenticate": 'Bearer realm="dmuon-server"'
                + (', error="invalid_token"' if auth else "")
            },
        )
        await response(scope, receive, send)
