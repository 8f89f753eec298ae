"""Which ``Host`` a request may name, and which ``Origin`` may write: the defence against
DNS rebinding.

A server without a token trusts whoever can reach its loopback port, which a web page of
another site can do through DNS rebinding (its name briefly resolves to 127.0.0.1): the
browser then sends ``Host: attacker.example:PORT``. Such a server answers only requests
whose ``Host`` is one of its names (``127.0.0.1``, ``localhost``, ``[::1]`` and the names
given with ``--allowed-host``), and a request that writes (``POST``, ``PUT``, ``PATCH``,
``DELETE``) from a browser must come from the server's own origin: its ``Origin``, when
it sends one, names the same host and port as its ``Host``. With a token the checks apply
only when ``--allowed-host`` is given (the token is the defence; a proxy in front may
rewrite ``Host``).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from dmuon_server.http.errors import ERROR_TEXT, problem_response

_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def split_host(value: str) -> tuple[str, str | None] | None:
    """``(name, port)`` of a ``Host`` header value (``name[:port]`` or ``[v6][:port]``),
    the name in lower case without a trailing dot; None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] or None
    elif value.count(":") > 1:  # an IPv6 address without brackets is not a Host
        return None
    else:
        name, _, port_text = value.partition(":")
        port = port_text or None
    if port is not None and not port.isdigit():
        return None
    name = name.rstrip(".")
    return (name, port) if name else None


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether the ``Origin`` header value names the host and port of the ``Host`` header
    of a request made over ``scheme``."""
    parts = urlsplit(origin.strip())
    if parts.scheme not in _DEFAULT_PORTS:
        return False
    theirs, ours = split_host(parts.netloc), split_host(host)
    if theirs is None or ours is None:
        return False
    return (theirs[0], theirs[1] or _DEFAULT_PORTS[parts.scheme]) == (
        ours[0],
        ours[1] or _DEFAULT_PORTS.get(scheme, "80"),
    )


class HostCheckMiddleware:
    """Refuse requests naming a foreign ``Host`` (400) and cross-origin writes (403)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        """Wrap ``app``; ``allowed`` are the host names (no port) requests may name."""
        self.app = app
        self.allowed = frozenset(n.lower().strip("[]").rstrip(".") for n in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, or answer it with a problem."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k: v for k, v in scope.get("headers", [])}
        host = headers.get(b"host", b"").decode("latin-1")
        parsed = split_host(host)
        if parsed is None or parsed[0] not in self.allowed:
            names = ", ".join(sorted(self.allowed))
            response = problem_response(
                400,
                "Unknown Host",
                f"this server answers requests addressed to {names} only (a page of another "
                "site may be trying to reach it through DNS rebinding); open it by one of "
                "those names, or start the server with --allowed-host NAME",
                kind="unknown-host",
                instance=scope.get("path"),
            )
            await response(scope, receive, send)
            return
        origin = headers.get(b"origin")
        scheme = scope.get("scheme", "http")
        if (
            scope.get("method") in _WRITES
            and origin is not None
            and not same_origin(origin.decode("latin-1"), host, scheme)
        ):
            response = problem_response(
                403,
                ERROR_TEXT[403],
                f"a request that changes something must come from this server's own pages; "
                f"its Origin {origin.decode('latin-1')!r} is not {host!r}",
                kind="cross-origin",
                instance=scope.get("path"),
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``.

    The protocol is given as ``IPPROTO_TCP`` on purpose: asyncio sets ``TCP_NODELAY`` on
    accepted connections only for sockets created that way, and without it every
    response on a kept-alive connection waits for the client's delayed ACK (about 40 ms).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock
