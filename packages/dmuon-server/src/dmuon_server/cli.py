"""``dmuon-server``: run the job service with uvicorn (one worker).

Authentication is on by default: without ``--token``, ``--token-file`` or
``--users-file`` the server makes a token (kept in ``<data-dir>/token``, mode 600) and
prints it with the dashboard's address, as Jupyter does; ``--no-auth`` turns it off, on a
loopback address only. ``--port 0`` picks a free port; the address actually bound is
printed and written to ``<data-dir>/server.json``.

Start-up order: check the flags and the token, take the secrets out of the environment,
choose the jobs' Unix accounts and sandbox, lock the data directory, check the data
directory and open the database, bind the socket, write ``server.json``, print
"listening". Every problem before that is one ``dmuon-server: error:`` line naming the
path and the cause, with exit status 2.

Secrets never stay where a process could read them: a token given with ``--token`` or in
``DMUON_SERVER_TOKEN``, and every variable named by ``--secret-env``, are read once, then
the server executes itself again without them (its ``/proc/<pid>/environ`` and
``/proc/<pid>/cmdline`` keep what a process started with), receiving the token through a
pipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from dmuon_server import __version__
from dmuon_server.config import (
    LOOPBACK_NAMES,
    TOKEN_ENV,
    Settings,
    flag_problem,
    settings_from_flags,
)
from dmuon_server.flags import build_parser
from dmuon_server.http.auth import (
    TokenError,
    check_token,
    exec_without_secrets,
    generated_token,
    read_token_file,
    secret_names,
)
from dmuon_server.http.hosts import is_loopback, listening_socket
from dmuon_server.launching import sandbox
from dmuon_server.launching.identity import IdentityError, JobIdentities
from dmuon_server.scheduling.gpus import GpuSpecError
from dmuon_server.scheduling.gpus import parse as parse_gpus
from dmuon_server.storage.datadir import (
    DataDirLock,
    StartupError,
    ensure_dir,
    write_server_info,
)
from dmuon_server.users import Users, UsersFileError

log = logging.getLogger("dmuon_server.cli")


def _error(message: str) -> int:
    print(f"dmuon-server: error: {message}", file=sys.stderr)
    return 2


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token, --token-file, the environment or the pipe of a server that
    executed itself again (checked), or None."""
    if args.token_fd is not None:
        with os.fdopen(args.token_fd, "rb") as pipe:
            return check_token(pipe.read().decode(), "the token pipe")
    given = [
        n for n, v in (("--token", args.token), ("--token-file", args.token_file)) if v is not None
    ]
    if len(given) > 1:
        raise TokenError("pass either --token or --token-file, not both")
    if args.token_file is not None:
        return read_token_file(args.token_file)
    if args.token is not None:
        return check_token(args.token, "--token")
    env = os.environ.get(TOKEN_ENV)
    if env is not None and env != "":
        return check_token(env, TOKEN_ENV)
    return None


def _allowed_hosts(args: argparse.Namespace, token: str | None) -> tuple[str, ...]:
    """The ``--allowed-host`` names, plus the loopback address a token-less server listens
    on when it is not one of the default names (say 127.0.0.2)."""
    names = list(args.allowed_host)
    bound = args.host.strip("[]").lower()
    if not token and args.users_file is None and is_loopback(bound) and bound not in LOOPBACK_NAMES:
        names.append(bound)
    return tuple(names)


def _reload_users(users: Users) -> None:
    """SIGHUP: read the users file again, or say there is none and carry on."""
    if users.path is None:
        log.info("SIGHUP: no --users-file to reload; the server carries on")
        return
    users.reload()


def main(argv: list[str] | None = None) -> int:
    """Parse flags, check them, lock the data directory, bind and serve until SIGINT/SIGTERM."""
    args = build_parser().parse_args(argv)
    try:
        token = _token(args)
    except TokenError as e:
        return _error(str(e))
    os.umask(0o077)  # the database, server.json, logs: the server's alone
    secrets = secret_names(TOKEN_ENV, args.secret_env)
    if argv is None and (secrets or args.token is not None):
        exec_without_secrets(sys.argv[1:], token, secrets)
    for name in secrets:  # called in-process (argv given): at least out of os.environ
        os.environ.pop(name, None)
    try:
        token, token_file, made_token = _resolve_auth(args, token)
        settings, users, isolation = _configure(args, token, token_file)
    except StartupError as e:
        return _error(str(e))

    from dmuon_server.app import create_app

    lock = DataDirLock(settings.data_dir)
    try:
        lock.acquire()
        app = create_app(settings, lock=lock, users=users)
    except StartupError as e:
        return _error(str(e))
    host = args.host.strip("[]")
    try:
        sock = listening_socket(host, args.port)
    except OSError as e:
        return _error(f"cannot listen on {host}:{args.port}: {e.strerror or e}")
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{port}"
    write_server_info(
        settings.data_dir, {"url": url, "host": host, "port": port, "pid": os.getpid()}
    )
    _announce(url, settings, isolation, token if made_token else None, token_file)
    return _serve(app, sock, args.log_level, users, lock)


def _resolve_auth(
    args: argparse.Namespace, token: str | None
) -> tuple[str | None, Path | None, bool]:
    """The token, its file, and whether the server made it; refuse contradictory flags and
    a server open to the network without a token (raises :class:`StartupError`)."""
    if args.no_auth and (token is not None or args.users_file is not None):
        raise StartupError(
            f"--no-auth contradicts --token, --token-file, --users-file and {TOKEN_ENV}; "
            "pass one or the other"
        )
    if not is_loopback(args.host) and args.no_auth:
        raise StartupError(
            f"refusing to listen on {args.host} without a token (--no-auth); drop --no-auth "
            "(the server makes a token), pass --token-file or --users-file, or listen on "
            "127.0.0.1"
        )
    if token is not None or args.users_file is not None or args.no_auth:
        return token, args.token_file, False
    try:
        ensure_dir(args.data_dir, "data directory")
        token, token_file, _ = generated_token(args.data_dir)
    except TokenError as e:
        raise StartupError(str(e)) from None
    return token, token_file, True


def _configure(
    args: argparse.Namespace, token: str | None, token_file: Path | None
) -> tuple[Settings, Users, str]:
    """Check the remaining flags, load the users and choose the sandbox: the settings, the
    users and how jobs are isolated (raises :class:`StartupError`)."""
    problem = flag_problem(args)
    if problem is not None:
        raise StartupError(problem)
    try:
        gpus = parse_gpus(args.gpus)
        users = Users(args.users_file, token)
    except (GpuSpecError, UsersFileError) as e:
        raise StartupError(str(e)) from None
    if not is_loopback(args.host) and not users.all():
        raise StartupError(
            f"refusing to listen on {args.host}: the users file {args.users_file} has no users "
            "and no token is given, so nobody could sign in; add a user to the file, pass "
            f"--token-file or set {TOKEN_ENV}, or listen on 127.0.0.1"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_from_flags(args, token, token_file, gpus, _allowed_hosts(args, token))
    try:
        identities = JobIdentities(settings, users)
        problem = identities.startup_problem()
        if problem is not None:
            raise StartupError(problem)
        chosen, isolation = sandbox.choose(
            args.sandbox, args.launcher, identities.job_user, args.job_network
        )
    except IdentityError as e:
        raise StartupError(str(e)) from None
    return dataclasses.replace(settings, sandbox=chosen), users, isolation


def _announce(
    url: str, settings: Settings, isolation: str, made_token: str | None, token_file: Path | None
) -> None:
    """Say where the server listens, how jobs are isolated, and a token it made."""
    print(
        f"dmuon-server {__version__} listening on {url} (data dir {settings.data_dir})", flush=True
    )
    print(f"    {isolation}", flush=True)
    if made_token is not None:
        # As Jupyter does: the dashboard's address with the token, which stays in the
        # fragment (browsers never send it), and the file clients can read it from.
        print(
            f"    open the dashboard at {url}/#token={made_token}\n"
            f"    or send 'Authorization: Bearer <token>', the token being in {token_file}",
            flush=True,
        )


def _serve(app: Any, sock: socket.socket, log_level: str, users: Users, lock: DataDirLock) -> int:
    """Serve ``app`` on ``sock`` until SIGINT or SIGTERM; SIGHUP reloads the users file.
    The exit status: 0 when the server had started."""
    import uvicorn

    config = uvicorn.Config(
        app,
        workers=1,
        log_level=log_level,
        timeout_graceful_shutdown=3,
        access_log=log_level == "debug",
    )
    hub = app.state.hub

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # End the event streams first, so uvicorn's graceful shutdown finds their
            # connections closing instead of cancelling them.
            hub.shutdown()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    server = _Server(config)
    # SIGHUP reloads the users file; without one there is nothing to reload, and the
    # signal must not end the server (its default action).
    signal.signal(signal.SIGHUP, lambda signum, frame: _reload_users(users))
    try:
        server.run(sockets=[sock])
    finally:
        lock.release()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
