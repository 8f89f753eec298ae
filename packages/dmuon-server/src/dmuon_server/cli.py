"""``dmuon-server``: run the job service with uvicorn (one worker).

Refuses to listen on a non-loopback address without a token. ``--port 0`` picks a free
port; the address actually bound is printed and written to ``<data-dir>/server.json``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import socket
import sys
from pathlib import Path

from dmuon_server import __version__
from dmuon_server.config import TOKEN_ENV, Settings, usable_cpus


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``dmuon-server``."""
    p = argparse.ArgumentParser(
        prog="dmuon-server",
        description="Job controller that launches DMuon training with torchrun and streams "
        "its step/loss metrics over REST and Server-Sent Events.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    p.add_argument("--data-dir", type=Path, default=Path(".dmuon"), help="state and job folders")
    p.add_argument(
        "--token",
        default=None,
        help=f"bearer token required on every endpoint but /healthz (or env {TOKEN_ENV}); "
        "mandatory on a non-loopback --host",
    )
    p.add_argument("--max-concurrent-jobs", type=int, default=1, help="jobs running at once")
    p.add_argument(
        "--max-nproc",
        type=int,
        default=usable_cpus(),
        help="largest nproc_per_node a job may ask for (default: usable CPUs)",
    )
    p.add_argument(
        "--data-root",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder train.data may point into (repeatable); default: <data-dir>/datasets "
        "and the current folder",
    )
    p.add_argument(
        "--cancel-grace", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL"
    )
    p.add_argument(
        "--heartbeat", type=float, default=15.0, help="seconds between SSE heartbeat comments"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags, check them, bind the socket and serve until SIGINT/SIGTERM."""
    args = build_parser().parse_args(argv)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host) and not token:
        print(
            f"dmuon-server: error: refusing to listen on {args.host} without a token; pass "
            f"--token or set {TOKEN_ENV}, or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    for name, value in (
        ("--max-concurrent-jobs", args.max_concurrent_jobs),
        ("--max-nproc", args.max_nproc),
    ):
        if value < 1:
            print(f"dmuon-server: error: {name} must be at least 1", file=sys.stderr)
            return 2
    if args.cancel_grace < 0 or args.heartbeat <= 0:
        print("dmuon-server: error: --cancel-grace >= 0 and --heartbeat > 0", file=sys.stderr)
        return 2
    settings = Settings(
        data_dir=args.data_dir,
        token=token,
        max_concurrent_jobs=args.max_concurrent_jobs,
        max_nproc_per_node=args.max_nproc,
        data_roots=tuple(args.data_root) if args.data_root else None,
        cancel_grace_s=args.cancel_grace,
        heartbeat_s=args.heartbeat,
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    import uvicorn

    from dmuon_server.app import create_app

    host = args.host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, args.port))
    except OSError as e:
        print(f"dmuon-server: error: cannot listen on {host}:{args.port}: {e}", file=sys.stderr)
        return 2
    sock.listen(128)
    sock.set_inheritable(False)
    port = sock.getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{port}"
    try:
        app = create_app(settings)
    except Exception as e:
        print(f"dmuon-server: error: {e}", file=sys.stderr)
        return 2
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    info = {"url": url, "host": host, "port": port, "pid": os.getpid()}
    tmp = settings.data_dir / f".server.json.{os.getpid()}"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, settings.data_dir / "server.json")
    print(
        f"dmuon-server {__version__} listening on {url} (data dir {settings.data_dir})", flush=True
    )
    config = uvicorn.Config(
        app,
        workers=1,
        log_level=args.log_level,
        timeout_graceful_shutdown=3,
        access_log=args.log_level == "debug",
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except RuntimeError as e:  # e.g. another server holds the data directory
        print(f"dmuon-server: error: {e}", file=sys.stderr)
        return 2
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
