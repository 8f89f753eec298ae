"""Soak of the job service: many queued jobs, many event streams, a server restart.

One ``dmuon-server`` with declared GPUs (``--gpus 0,1,2,3``) gets ``--jobs`` small jobs at
once (1 and 2 processes, two priorities) of the stand-in recipe the server tests use
(``tests/server/fake_train.py``; ``--recipe real`` runs the ``tiny`` preset instead).
``--clients`` threads follow jobs' event streams (reconnecting with ``Last-Event-ID``, as
a browser does), a poller times ``GET /v1/jobs`` and ``GET /v1/jobs/{id}`` and checks that
no two active jobs hold one GPU, and halfway the server is killed (``--restart kill``,
SIGKILL; or ``term``) and started again on the same port. At the end it checks:

* no job lost or run twice: every job succeeded after exactly one attempt, its metrics
  hold each step once, and every stream saw each step once, in order, to its ``end``;
* no device leaked: no two active jobs ever shared a GPU, and none is busy at the end;
* no orphan process: nothing carrying the data directory's marker is left;

and prints the latencies (median, p99, max) of the REST calls.

    python benchmarks/server_soak.py                      # 200 jobs, 20 streams
    python benchmarks/server_soak.py --jobs 40 --clients 5 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from cli_types import positive_int

REPO = Path(__file__).resolve().parents[1]
FAKE = REPO / "tests" / "server"
TERMINAL = {"succeeded", "failed", "cancelled"}


class Server:
    """A ``dmuon-server`` process that can be killed and started again on its port."""

    def __init__(self, data_dir: Path, flags: list[str], env: dict[str, str]) -> None:
        """Remember how to start it."""
        self.data_dir, self.flags, self.env = data_dir, flags, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""
        self.log = data_dir.parent / "server.log"
        self.token = secrets.token_urlsafe(32)
        self.token_file = data_dir.parent / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)

    def client(self) -> httpx.Client:
        """An HTTP client of the server, signed in with its token."""
        headers = {"Authorization": f"Bearer {self.token}"}
        return httpx.Client(base_url=self.url, timeout=60, headers=headers)

    def start(self) -> None:
        """Start it (on the port of the previous start, if any) and wait for /healthz."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "server.json").unlink(missing_ok=True)
        argv = [sys.executable, "-m", "dmuon_server.cli", "--data-dir", str(self.data_dir)]
        argv += ["--port", str(self.port), "--allow-same-user-jobs", "--sandbox", "none"]
        argv += ["--token-file", str(self.token_file)]
        argv += self.flags
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {self.log.read_text()[-2000:]}")
            try:
                info = json.loads((self.data_dir / "server.json").read_text())
                if info.get("pid") == self.proc.pid:
                    self.url, self.port = info["url"], info["port"]
                    if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                        return
            except (FileNotFoundError, ValueError, KeyError, httpx.HTTPError):
                pass
            time.sleep(0.1)
        raise SystemExit("the server did not start within 120 s")

    def stop(self, how: str) -> None:
        """SIGKILL (``kill``) or SIGTERM (``term``) it and wait."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
        self.proc.wait(timeout=60)


def spec(i: int, steps: int, recipe: str) -> dict[str, Any]:
    """Job ``i``: 1 or 2 processes, priority 5 for every fifth."""
    train = {
        "model": "tiny",
        "steps": steps,
        "micro_batch_size": 2,
        "accum_steps": 1,
        "seq_len": 32,
        "lr": 0.02,
        "adamw_lr": 0.003,
        "optimizer": "dmuon",
        "mode": "z2",
        "seed": i,
        "eval_every": 0,
        "checkpoint_every": 0,
    }
    if recipe == "real":
        train["warmup_steps"] = 1
    return {
        "name": f"soak-{i}",
        "nproc_per_node": 1 + i % 2,
        "priority": 5 if i % 5 == 0 else 0,
        "train": train,
    }


class Follower(threading.Thread):
    """One SSE client of one job: reconnects with Last-Event-ID until the job's ``end``."""

    def __init__(self, server: Server, job_id: str, stop: threading.Event) -> None:
        """Follow ``job_id`` on ``server`` until ``stop`` or the end."""
        super().__init__(daemon=True)
        self.server, self.job_id, self.stop = server, job_id, stop
        self.steps: list[int] = []
        self.end: dict[str, Any] | None = None
        self.reconnects = 0

    def run(self) -> None:
        """Read events; on a drop (the restart) wait a moment and reconnect."""
        last: str | None = None
        while not self.stop.is_set() and self.end is None:
            headers = {"Last-Event-ID": last} if last is not None else {}
            try:
                with (
                    self.server.client() as c,
                    c.stream("GET", f"/v1/jobs/{self.job_id}/events", headers=headers) as r,
                ):
                    if r.status_code == 204:
                        # The job ended while this client was away (the server's kill came
                        # between its last point and its end event): nothing is left to
                        # send, so its end is what the REST API says it is.
                        state = c.get(f"/v1/jobs/{self.job_id}").json()["state"]
                        self.end = {"state": state, "via": "204"}
                        return
                    event = ""
                    for line in r.iter_lines():
                        if line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("id: "):
                            last = line[4:]
                        elif line.startswith("data: ") and event == "metric":
                            self.steps.append(json.loads(line[6:])["step"])
                        elif line.startswith("data: ") and event == "end":
                            data = json.loads(line[6:])
                            if data.get("reason") != "server_shutdown":
                                self.end = data
                                return
            except httpx.HTTPError:
                pass
            self.reconnects += 1
            time.sleep(0.5)


def poll(server: Server, ids: list[str], stop: threading.Event, out: dict[str, Any]) -> None:
    """Time REST reads and check that active jobs never share a GPU, until ``stop``."""
    i = 0
    with server.client() as c:
        while not stop.is_set():
            try:
                t0 = time.perf_counter()
                r = c.get("/v1/jobs", params={"limit": 200})
                out["list"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                c.get(f"/v1/jobs/{ids[i % len(ids)]}")
                out["get"].append(time.perf_counter() - t0)
            except httpx.HTTPError:
                out["errors"] += 1  # the server is restarting
                time.sleep(0.2)
                continue
            i += 1
            held: list[int] = []
            for job in r.json()["items"]:
                if job["state"] in ("starting", "running"):
                    held += job["gpus"]
            out["samples"] += 1
            if len(held) != len(set(held)):
                out["shared"].append(sorted(held))
            time.sleep(0.05)


def count_jobs(server: Server, states: set[str]) -> int:
    """How many jobs are in ``states`` (following the list's pages)."""
    n, cursor = 0, None
    with server.client() as c:
        while True:
            params: dict[str, Any] = {"limit": 200, "state": sorted(states)}
            if cursor:
                params["cursor"] = cursor
            page = c.get("/v1/jobs", params=params).json()
            n += len(page["items"])
            cursor = page["next"]
            if not cursor:
                return n


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print the checks and latencies; exit 1 if a check failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=positive_int, default=200)
    p.add_argument("--clients", type=positive_int, default=20, help="event-stream clients")
    p.add_argument("--steps", type=positive_int, default=5, help="steps of each job")
    p.add_argument("--recipe", choices=["fake", "real"], default="fake")
    p.add_argument("--restart", choices=["kill", "term"], default="kill")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    flags = ["--gpus", "0,1,2,3", "--max-nproc", "2", "--heartbeat", "2"]
    with tempfile.TemporaryDirectory(prefix="dmuon-soak-") as tmp:
        data_dir = Path(tmp) / "data"
        server = Server(data_dir, flags, _environment(args.recipe))
        server.start()
        t_start = time.monotonic()
        submit, ids = _submit_all(server, args)
        stop = threading.Event()
        timings: dict[str, Any] = {"list": [], "get": [], "errors": 0, "samples": 0, "shared": []}
        poller = threading.Thread(target=poll, args=(server, ids, stop, timings), daemon=True)
        poller.start()
        # Streams of priority-0 jobs spread over the queue: early ones, ones the restart
        # catches running, and ones that start after it.
        plain = [job_id for i, job_id in enumerate(ids) if spec(i, 1, "fake")["priority"] == 0]
        step = max(1, len(plain) // args.clients)
        followers = [Follower(server, plain[k * step], stop) for k in range(args.clients)]
        for f in followers:
            f.start()
        while count_jobs(server, TERMINAL) < args.jobs // 2:
            time.sleep(1)
        t_restart = time.monotonic() - t_start
        server.stop(args.restart)
        time.sleep(1.0)
        server.start()
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline and count_jobs(server, TERMINAL) < args.jobs:
            time.sleep(2)
        with server.client() as c:
            jobs = [c.get(f"/v1/jobs/{i}").json() for i in ids]
            prom = c.get("/metrics").text
        wall = time.monotonic() - t_start
        for f in followers:
            f.join(timeout=60)
        stop.set()
        poller.join(timeout=60)
        result = _checks(args, data_dir, ids, jobs, followers, prom)
        server.stop("term")
    result.update(
        restart_at_s=round(t_restart, 1),
        wall_s=round(wall, 1),
        gpu_samples=timings["samples"],
        gpu_shared=timings["shared"],
        rest=_latencies(submit, timings),
        read_errors_during_restart=timings["errors"],
    )
    ok = _report(args, result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


def _environment(recipe: str) -> dict[str, str]:
    """The server's environment: the fake recipe on the path, or the real one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    if recipe == "fake":
        env["PYTHONPATH"] = str(FAKE) + os.pathsep + env.get("PYTHONPATH", "")
        env["DMUON_SERVER_TRAIN_MODULE"] = "fake_train"
        env["FAKE_STEP_SECONDS"] = "0.05"
    else:
        env.pop("DMUON_SERVER_TRAIN_MODULE", None)
    return env


def _submit_all(server: Server, args: argparse.Namespace) -> tuple[list[float], list[str]]:
    """Submit every job; each submission's seconds, and the job ids."""
    submit: list[float] = []
    ids: list[str] = []
    with server.client() as c:
        for i in range(args.jobs):
            t0 = time.perf_counter()
            r = c.post("/v1/jobs", json=spec(i, args.steps, args.recipe))
            submit.append(time.perf_counter() - t0)
            r.raise_for_status()
            ids.append(r.json()["id"])
    return submit, ids


def _checks(
    args: argparse.Namespace,
    data_dir: Path,
    ids: list[str],
    jobs: list[dict[str, Any]],
    followers: list[Follower],
    prom: str,
) -> dict[str, Any]:
    """What the soak checks once every job ended: states, attempts, starts, points,
    streams, GPUs still marked busy and processes left behind."""
    states: dict[str, int] = {}
    for job in jobs:
        states[job["state"]] = states.get(job["state"], 0) + 1
    starts = []
    for job_id in ids:
        log = (data_dir / "jobs" / job_id / "job.log").read_text(errors="replace")
        starts.append(log.count("fake_train rank 0/") if args.recipe == "fake" else 1)
    bad_streams = [
        f.job_id
        for f in followers
        if f.steps != list(range(1, args.steps + 1))
        or not f.end
        or f.end.get("state") != "succeeded"
    ]
    busy = next(
        (int(line.split()[1]) for line in prom.splitlines() if line.startswith("dmuon_gpus_busy ")),
        -1,
    )
    marker = str(Path(os.path.realpath(data_dir)))
    orphans = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DMUON_SERVER_DATA_DIR") == marker:
                orphans.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return {
        "load_average_at_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "jobs": args.jobs,
        "clients": args.clients,
        "steps": args.steps,
        "recipe": args.recipe,
        "restart": args.restart,
        "states": states,
        "lost": [j["id"] for j in jobs if j["state"] != "succeeded"],
        "attempts_not_one": [j["id"] for j in jobs if len(j["attempts"]) != 1],
        "started_not_once": [i for i, n in zip(ids, starts, strict=True) if n != 1],
        "points_not_steps": [j["id"] for j in jobs if j["summary"]["points"] != args.steps],
        "streams_not_exact": bad_streams,
        "stream_reconnects": sum(f.reconnects for f in followers),
        "gpus_busy_at_end": busy,
        "orphans": orphans,
    }


def _latencies(submit: list[float], timings: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Median, 99th percentile and maximum of each kind of REST call, in ms."""
    reads = timings["list"] + timings["get"]
    return {
        name: {
            "n": len(v),
            "median_ms": statistics.median(v) * 1e3,
            "p99_ms": pct(v, 0.99) * 1e3,
            "max_ms": max(v) * 1e3,
        }
        for name, v in (
            ("POST /v1/jobs", submit),
            ("GET /v1/jobs", timings["list"]),
            ("GET /v1/jobs/{id}", timings["get"]),
            ("reads", reads),
        )
        if v
    }


def _report(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    """Print the checks and latencies; whether every check passed."""
    lost, twice, run_twice = result["lost"], result["attempts_not_one"], result["started_not_once"]
    bad_points, bad_streams = result["points_not_steps"], result["streams_not_exact"]
    busy, orphans, shared = result["gpus_busy_at_end"], result["orphans"], result["gpu_shared"]
    ok = not (lost or twice or run_twice or bad_points or bad_streams or shared or busy or orphans)
    print(f"{args.jobs} jobs, {args.clients} streams, restart ({args.restart}) at "
          f"{result['restart_at_s']} s, all done at {result['wall_s']} s: "
          f"{result['states']}")  # fmt: skip
    print(f"lost {len(lost)}, more than one attempt {len(twice)}, started twice {len(run_twice)},"
          f" wrong point count {len(bad_points)}, streams not exact {len(bad_streams)} "
          f"({result['stream_reconnects']} reconnects)")  # fmt: skip
    print(f"GPUs: {result['gpu_samples']} samples, shared {len(shared)} times, busy at "
          f"the end {busy}; orphan processes {len(orphans)}")  # fmt: skip
    for name, r in result["rest"].items():
        print(f"{name:<20} n={r['n']:<6} median {r['median_ms']:7.2f} ms  p99 {r['p99_ms']:8.2f}"
              f" ms  max {r['max_ms']:8.2f} ms")  # fmt: skip
    print("OK" if ok else "FAILED")
    return ok


if __name__ == "__main__":
    sys.exit(main())
