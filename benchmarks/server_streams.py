"""Event streams at scale: the job service's CPU with many idle streams open, and its REST
latency under a steady request rate while they stay open, on loopback.

One ``dmuon-server`` runs one script job that sleeps (it holds the only job slot) and
keeps ``--jobs - 1`` more queued behind it, so their streams stay open and quiet. The run:

1. measures the server's CPU over ``--idle-s`` seconds with no stream open (the baseline);
2. opens ``--streams`` event streams spread over the jobs, waits until each has its first
   ``state`` event, and measures the server's CPU again over ``--idle-s`` seconds;
3. closes all but ``--load-streams`` of them and sends ``GET /v1/jobs/{id}`` and
   ``GET /v1/jobs`` (alternately) at ``--rps`` requests per second for ``--load-s`` seconds,
   each on its own schedule (a slow answer does not delay the next request), and reports
   the latency's median, p99 and maximum, and the rate achieved.

CPU is the server process's user + system time over the wall time, as a share of one core.

    python benchmarks/server_streams.py                       # 1,000 idle, 500 under load
    python benchmarks/server_streams.py --streams 200 --load-s 5 --json /tmp/streams.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from cli_types import positive_int
from server_rps import start_server

#: The script every job runs: it prints nothing and sleeps, so its streams stay idle.
IDLE_SCRIPT = "import time\ntime.sleep(3600)\n"


def server_cpu(proc: psutil.Process, seconds: float) -> float:
    """The share of one core ``proc`` used over the next ``seconds``."""
    before = proc.cpu_times()
    t0 = time.monotonic()
    time.sleep(seconds)
    after = proc.cpu_times()
    busy = (after.user - before.user) + (after.system - before.system)
    return busy / (time.monotonic() - t0)


async def open_stream(client: httpx.AsyncClient, job_id: str, ready: asyncio.Event) -> None:
    """Follow one job's events until cancelled; set ``ready`` at its first ``state``."""
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line == "event: state":
                ready.set()


async def timed_get(client: httpx.AsyncClient, path: str, latencies: list[float]) -> None:
    """GET ``path`` and record its latency in milliseconds."""
    t0 = time.perf_counter()
    r = await client.get(path)
    r.raise_for_status()
    latencies.append((time.perf_counter() - t0) * 1000)


async def measure(url: str, ids: list[str], proc: psutil.Process, args: Any) -> dict[str, Any]:
    """Steps 1-3 of the module's docstring; returns the figures."""
    result: dict[str, Any] = {"streams": args.streams, "load_streams": args.load_streams}
    result["idle_cpu_no_streams"] = await asyncio.to_thread(server_cpu, proc, args.idle_s)
    unlimited = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    streams = httpx.AsyncClient(base_url=url, timeout=None, limits=unlimited)
    tasks: list[asyncio.Task[None]] = []
    readies: list[asyncio.Event] = []
    t0 = time.perf_counter()
    for i in range(args.streams):
        ready = asyncio.Event()
        readies.append(ready)
        tasks.append(asyncio.create_task(open_stream(streams, ids[i % len(ids)], ready)))
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), timeout=300)
    result["open_s"] = time.perf_counter() - t0
    await asyncio.sleep(2.0)  # let the last connections' set-up settle
    result["idle_cpu_streams"] = await asyncio.to_thread(server_cpu, proc, args.idle_s)
    for task in tasks[args.load_streams :]:
        task.cancel()
    await asyncio.gather(*tasks[args.load_streams :], return_exceptions=True)
    latencies: list[float] = []
    requests = httpx.AsyncClient(base_url=url, timeout=120, limits=unlimited)
    pending: list[asyncio.Task[None]] = []
    total = int(args.rps * args.load_s)
    start = time.perf_counter()
    for k in range(total):
        await asyncio.sleep(max(0.0, start + k / args.rps - time.perf_counter()))
        path = f"/v1/jobs/{ids[k % len(ids)]}" if k % 2 == 0 else "/v1/jobs"
        pending.append(asyncio.create_task(timed_get(requests, path, latencies)))
    await asyncio.gather(*pending)
    elapsed = time.perf_counter() - start
    latencies.sort()
    result.update(
        requests=total,
        achieved_rps=total / elapsed,
        p50_ms=statistics.median(latencies),
        p99_ms=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        max_ms=latencies[-1],
    )
    for task in tasks[: args.load_streams]:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await streams.aclose()
    await requests.aclose()
    return result


def main() -> None:
    """Start the server, queue the jobs, measure, print (and write ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=positive_int, default=1000, help="idle streams to open")
    p.add_argument("--load-streams", type=positive_int, default=500, help="streams kept open")
    p.add_argument("--jobs", type=positive_int, default=10, help="jobs the streams follow")
    p.add_argument("--rps", type=positive_int, default=50, help="REST requests per second")
    p.add_argument("--load-s", type=float, default=10.0, help="seconds of REST load")
    p.add_argument(
        "--idle-s",
        type=float,
        default=30.0,
        help="seconds each CPU sample lasts (at least two heartbeat periods of 15 s)",
    )
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    args = p.parse_args()
    if args.load_streams > args.streams:
        p.error("--load-streams may not exceed --streams")
    with tempfile.TemporaryDirectory(prefix="dmuon-streams-", ignore_cleanup_errors=True) as tmp:
        code = Path(tmp) / "code"
        code.mkdir()
        (code / "idle.py").write_text(IDLE_SCRIPT)
        flags = ["--code-root", str(code), "--gpus", "none", "--max-concurrent-jobs", "1"]
        server, url = start_server(Path(tmp) / "data", flags)
        try:
            spec = {"nproc_per_node": 1, "script": {"path": "idle.py"}}
            with httpx.Client(base_url=url, timeout=30) as c:
                ids = []
                for _ in range(args.jobs):
                    r = c.post("/v1/jobs", json=spec)
                    r.raise_for_status()
                    ids.append(r.json()["id"])
                result = asyncio.run(measure(url, ids, psutil.Process(server.pid), args))
                for job_id in ids:
                    c.post(f"/v1/jobs/{job_id}/cancel")
                _wait_until_ended(c, ids)  # their processes stop writing in the folder
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"{args.jobs} jobs (1 running, {args.jobs - 1} queued), loopback")
    print(
        f"server CPU, idle, no stream:        {100 * result['idle_cpu_no_streams']:6.2f}% of a core"
    )
    print(
        f"server CPU, idle, {args.streams:>5} streams:     "
        f"{100 * result['idle_cpu_streams']:6.2f}% of a core (opened in {result['open_s']:.1f} s)"
    )
    print(
        f"REST with {args.load_streams} streams open: {result['requests']} requests at "
        f"{result['achieved_rps']:.1f}/s, p50 {result['p50_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps({**result, "argv": sys.argv[1:]}, indent=2) + "\n")


def _wait_until_ended(client: httpx.Client, ids: list[str], timeout_s: float = 60.0) -> None:
    """Poll the jobs until every one is in a terminal state (or ``timeout_s`` passed)."""
    from dmuon_server.schemas import TERMINAL_STATES

    deadline = time.monotonic() + timeout_s
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        pending = {i for i in pending if client.get(f"/v1/jobs/{i}").json().get("state")
                   not in TERMINAL_STATES}  # fmt: skip
        if pending:
            time.sleep(0.2)


if __name__ == "__main__":
    main()
