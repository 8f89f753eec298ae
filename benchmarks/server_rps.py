"""Requests per second of the job service: one kept-alive connection against a new
connection per request, in one run against one ``dmuon-server`` process.

A kept-alive connection skips the TCP handshake, so it should be the faster of the two;
if it is several times slower, responses are waiting for the client's delayed ACK
(``TCP_NODELAY`` missing on accepted sockets). The report gives both rates and their
ratio, measured in rounds that alternate the two modes.

    python benchmarks/server_rps.py --requests 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cli_types import positive_int


def start_server(
    data_dir: Path, flags: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dmuon-server --port 0`` (with ``flags``; ``--no-auth`` unless they give a
    token or users) and return it with its URL once /healthz answers."""
    flags = list(flags or [])
    if not {"--token", "--token-file", "--users-file"} & set(flags):
        flags.append("--no-auth")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "dmuon_server.cli", "--port", "0"),
            *("--data-dir", str(data_dir), "--allow-same-user-jobs", "--sandbox", "none"),
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            url = json.loads((data_dir / "server.json").read_text())["url"]
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except (FileNotFoundError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start within 60 s")


def keep_alive_rate(url: str, path: str, n: int) -> float:
    """Requests per second, ``n`` requests on one connection."""
    with httpx.Client(base_url=url, timeout=10) as c:
        c.get(path)
        t0 = time.perf_counter()
        for _ in range(n):
            c.get(path).raise_for_status()
        return n / (time.perf_counter() - t0)


def new_connection_rate(url: str, path: str, n: int) -> float:
    """Requests per second, each request on a connection of its own."""
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=url, timeout=10, limits=no_reuse) as c:
        t0 = time.perf_counter()
        for _ in range(n):
            c.get(path).raise_for_status()
        return n / (time.perf_counter() - t0)


def main() -> None:
    """Run the rounds and print the rates and their ratio."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=200, help="requests per mode and round")
    p.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds")
    p.add_argument("--path", default="/healthz", help="endpoint to request")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dmuon-rps-") as tmp:
        proc, url = start_server(Path(tmp))
        try:
            keep, fresh = [], []
            for _ in range(args.rounds):
                keep.append(keep_alive_rate(url, args.path, args.requests))
                fresh.append(new_connection_rate(url, args.path, args.requests))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    k, f = statistics.median(keep), statistics.median(fresh)
    print(f"GET {args.path}, {args.requests} requests x {args.rounds} rounds (median)")
    print(f"one kept-alive connection: {k:8.0f} requests/s ({1000 / k:.2f} ms each)")
    print(f"a connection per request:  {f:8.0f} requests/s ({1000 / f:.2f} ms each)")
    print(f"kept-alive / new connections: {k / f:.2f}x")


if __name__ == "__main__":
    main()
