"""Server-Sent Events against a real uvicorn server (``dmuon-server --port 0``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    SAME_USER_JOBS,
    SERVER_TESTS,
    LiveServer,
    SSEEvent,
    iter_sse,
    job_spec,
    wait_until,
)


def _env(**fake: str) -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    env = {
        "PYTHONPATH": str(SERVER_TESTS) + (os.pathsep + pp if pp else ""),
        "DMUON_SERVER_TRAIN_MODULE": "fake_train",
        "FAKE_STEP_SECONDS": "0.02",
    }
    env.update(fake)
    return env


@pytest.fixture
def server_factory(data_dir: Path) -> Iterator:
    servers: list[LiveServer] = []

    def start(*extra: str, **fake: str) -> LiveServer:
        s = LiveServer(data_dir, "--heartbeat", "0.3", *extra, env=_env(**fake)).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def _collect(
    c: httpx.Client, job_id: str, headers: dict | None = None, params: dict | None = None
) -> tuple[httpx.Response, list[SSEEvent]]:
    events: list[SSEEvent] = []
    with c.stream(
        "GET", f"/v1/jobs/{job_id}/events", headers=headers or {}, params=params or {}
    ) as r:
        if r.status_code == 200:
            for ev in iter_sse(r):
                events.append(ev)
                if ev.event == "end":
                    break
        return r, events


def test_stream_of_a_job_from_start_to_end(server_factory) -> None:
    server = server_factory(FAKE_STEP_SECONDS="0.05")
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(steps=30, eval_every=10)).json()
        r, events = _collect(c, job["id"])
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    metrics = [e for e in events if e.event == "metric"]
    assert [int(e.id) for e in metrics] == list(range(31))  # step 0 eval, then 1..30
    assert all(e.json()["step"] == int(e.id) for e in metrics)
    assert metrics[10].json()["val_loss"] is not None
    states = [e.json()["state"] for e in events if e.event == "state"]
    assert states[-1] == "succeeded" and "running" in states
    assert states == sorted(set(states), key=states.index)  # no state twice
    end = events[-1]
    assert end.event == "end" and end.json()["state"] == "succeeded"
    assert end.json()["exit_code"] == 0 and end.json()["last_step"] == 30
    # Order: all metrics arrive before the final state and the end.
    last_metric = max(i for i, e in enumerate(events) if e.event == "metric")
    final_state = max(i for i, e in enumerate(events) if e.event == "state")
    assert last_metric < final_state < len(events) - 1


def test_late_client_and_resume(server_factory) -> None:
    server = server_factory()
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(steps=12)).json()
        wait_until(
            lambda: c.get(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded", 60, "success"
        )
        # A late client sees the whole curve, then the end.
        _, events = _collect(c, job["id"])
        assert [int(e.id) for e in events if e.event == "metric"] == list(range(1, 13))
        assert events[-1].event == "end"
        # Resume after the step the client saw last.
        _, events = _collect(c, job["id"], headers={"Last-Event-ID": "8"})
        assert [int(e.id) for e in events if e.event == "metric"] == [9, 10, 11, 12]
        _, events = _collect(c, job["id"], params={"after_step": 10})
        assert [int(e.id) for e in events if e.event == "metric"] == [11, 12]
        # Last-Event-ID wins over after_step (a browser reconnects to the same URL).
        _, events = _collect(
            c, job["id"], headers={"Last-Event-ID": "11"}, params={"after_step": 2}
        )
        assert [int(e.id) for e in events if e.event == "metric"] == [12]
        # Nothing left for a finished job: 204 tells EventSource to stop reconnecting.
        r, _ = _collect(c, job["id"], headers={"Last-Event-ID": "12"})
        assert r.status_code == 204
        bad = c.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": "x"})
        assert bad.status_code == 422
        assert bad.headers["content-type"].startswith("application/problem+json")


def test_heartbeats_active_streams_and_cancel_end(server_factory) -> None:
    server = server_factory(FAKE_STEP_SECONDS="30")  # no metric for a long time
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(steps=5)).json()
        with c.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            it = iter_sse(r)
            heartbeats = 0
            t0 = time.monotonic()
            for ev in it:
                if ev.event == ":":
                    heartbeats += 1
                    if heartbeats == 2:
                        break
            assert time.monotonic() - t0 < 10
            metrics = c.get("/metrics").text
            assert "dmuon_active_streams 1" in metrics
            c.post(f"/v1/jobs/{job['id']}/cancel")
            rest = []
            for ev in it:
                rest.append(ev)
                if ev.event == "end":
                    break
        assert rest[-1].json()["state"] == "cancelled"
        assert "cancelled" in [e.json()["state"] for e in rest if e.event == "state"]
        wait_until(lambda: "dmuon_active_streams 0" in c.get("/metrics").text, 10, "stream closed")


def test_non_finite_loss_in_the_stream(server_factory) -> None:
    server = server_factory(FAKE_NAN_STEP="2")
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(steps=3)).json()
        _, events = _collect(c, job["id"])
    metrics = {int(e.id): e.json() for e in events if e.event == "metric"}
    assert metrics[2]["loss"] == "NaN"
    assert isinstance(metrics[3]["loss"], float)
    assert events[-1].json()["state"] == "succeeded"


def test_cli_refuses_public_address_without_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TOKEN"}
    r = subprocess.run(
        [sys.executable, "-m", "dmuon_server.cli", "--host", "0.0.0.0", "--port", "0",
         "--data-dir", str(tmp_path / "d"), "--no-auth"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 2 and "without a token (--no-auth)" in r.stderr
    r = _cli("--data-dir", str(tmp_path / "d"), "--no-auth", "--token", "t-1", env=env)
    assert r.returncode == 2 and "--no-auth contradicts" in r.stderr


def test_a_server_without_auth_flags_makes_a_token_and_requires_it(tmp_path: Path) -> None:
    """The default: a token made once, kept mode 600 in the data directory, printed with
    the dashboard's address, required on every address, and the same after a restart."""
    data_dir = tmp_path / "d"
    server = LiveServer(data_dir, default_auth=True)
    tokens = []
    for _ in range(2):
        server.start()
        try:
            token_file = data_dir / "token"
            assert token_file.stat().st_mode & 0o777 == 0o600
            token = token_file.read_text().strip()
            tokens.append(token)
            assert len(token) >= 40
            printed = server.log_path.read_text()
            assert f"{server.url}/#token={token}" in printed
            assert httpx.get(server.url + "/healthz").status_code == 200
            for path in ("/v1/jobs", "/v1/me", "/v1/jobs/0123/events"):
                assert httpx.get(server.url + path).status_code == 401, path
            wrong = httpx.get(server.url + "/v1/jobs", headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401
            ok = httpx.get(server.url + "/v1/jobs", headers={"Authorization": f"Bearer {token}"})
            assert ok.status_code == 200
        finally:
            server.stop()
    assert tokens[0] == tokens[1]
    (data_dir / "token").chmod(0o644)  # a token others could read is not used
    r = _cli("--data-dir", str(data_dir))
    assert r.returncode == 2 and "may be read by other accounts" in r.stderr


def test_live_server_with_token(server_factory, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok-123\n")  # as `echo tok-123 > token` writes it
    server = server_factory("--token-file", str(token_file))
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/v1/jobs").status_code == 401
    ok = httpx.get(server.url + "/v1/jobs", headers={"Authorization": "Bearer tok-123"})
    assert ok.status_code == 200


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dmuon_server.cli", "--port", "0", *SAME_USER_JOBS, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_second_server_on_the_same_data_dir_is_refused(server_factory, data_dir: Path) -> None:
    first = server_factory()
    info = (data_dir / "server.json").read_text()
    r = _cli("--data-dir", str(data_dir))
    assert r.returncode == 2, r
    assert "listening" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"another dmuon-server (pid {first.proc.pid})" in lines[0]
    assert (data_dir / "server.json").read_text() == info  # the running server's file
    assert httpx.get(first.url + "/healthz").status_code == 200


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--token", "   "], {}, "only whitespace"),
        ([], {"DMUON_SERVER_TOKEN": "abc\n"}, "'\\n'"),
        (["--token", "two words"], {}, "' '"),
    ],
)
def test_tokens_no_client_could_send_are_refused(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    r = _cli("--data-dir", str(tmp_path / "d"), *args, env=env)
    assert r.returncode == 2 and message in r.stderr, r
    assert "listening" not in r.stdout and not (tmp_path / "d").exists()


def test_start_up_errors_name_the_path(tmp_path: Path) -> None:
    a_file = tmp_path / "plain-file"
    a_file.write_text("x")
    jobs_is_a_file = tmp_path / "d1"
    jobs_is_a_file.mkdir()
    (jobs_is_a_file / "jobs").write_text("x")
    corrupt = tmp_path / "d2"
    corrupt.mkdir()
    (corrupt / "dmuon-server.sqlite3").write_bytes(b"this is not a database" * 100)
    cases = [
        (a_file, str(a_file)),
        (a_file / "sub", str(a_file / "sub")),
        (jobs_is_a_file, str(jobs_is_a_file / "jobs")),
        (corrupt, str(corrupt / "dmuon-server.sqlite3")),
    ]
    for data_dir, named in cases:
        r = _cli("--data-dir", str(data_dir))
        assert r.returncode == 2, (data_dir, r)
        assert "listening" not in r.stdout and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("dmuon-server: error: ") and named in r.stderr, r.stderr


def test_keep_alive_requests_are_fast(server_factory) -> None:
    """One connection, 20 requests: each must answer in milliseconds, not wait ~40 ms for
    the client's delayed ACK (Nagle's algorithm without TCP_NODELAY)."""
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for _ in range(3):
            c.get("/v1/jobs")
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert c.get("/v1/jobs").status_code == 200
            times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    assert median < 0.020, f"median {median * 1000:.1f} ms on a kept-alive connection"


def test_body_limit_answers_before_the_body_is_sent(server_factory) -> None:
    """A declared 50 MB body is refused from its headers: the client never sends it."""
    server = server_factory()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n{"
        )
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413"), head
    assert "application/problem+json" in head


def test_stopping_the_server_ends_streams_with_a_reason(server_factory) -> None:
    server = server_factory(FAKE_STEP_SECONDS="30")
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(steps=5)).json()
        with c.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            events = iter_sse(r)
            # Stop the server once the job has left the queue (a loaded machine may take
            # a while to start it); its stream then ends with the state it was in.
            for event in events:
                if event.event == "state" and event.json()["state"] in {"starting", "running"}:
                    break
            server.proc.send_signal(signal.SIGTERM)
            rest = list(events)
    ends = [e for e in rest if e.event == "end"]
    assert len(ends) == 1 and ends[0].json()["reason"] == "server_shutdown", rest
    assert ends[0].json()["state"] in {"starting", "running"}
    # uvicorn re-raises the signal once it has shut down cleanly.
    assert server.proc.wait(timeout=20) in (0, -signal.SIGTERM)
    log = server.log_path.read_text()
    assert " ERROR " not in log and "Traceback" not in log, log[-3000:]


def test_client_disconnect_frees_the_stream(server_factory) -> None:
    server = server_factory(FAKE_STEP_SECONDS="30")
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(steps=5)).json()
        for _ in range(3):
            with (
                httpx.Client(base_url=server.url, timeout=30) as other,
                other.stream("GET", f"/v1/jobs/{job['id']}/events") as r,
            ):
                events = iter_sse(r)  # keep a reference: dropping it closes the response
                assert next(events).event == "state"
                assert "dmuon_active_streams 1" in c.get("/metrics").text
            wait_until(
                lambda: "dmuon_active_streams 0" in c.get("/metrics").text,
                10,
                "the server to notice the disconnect",
            )
        c.post(f"/v1/jobs/{job['id']}/cancel")


def test_concurrent_submissions_over_http_create_one_job(server_factory) -> None:
    server = server_factory()
    body = job_spec(steps=2)

    def submit(_: int) -> tuple[int, str]:
        with server.client() as c:
            r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-20"})
            return r.status_code, r.json()["id"]

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(submit, range(20)))
    assert sorted(code for code, _ in results) == [200] * 19 + [201]
    assert len({job_id for _, job_id in results}) == 1
    with server.client() as c:
        assert len(c.get("/v1/jobs").json()["items"]) == 1
        wait_until(
            lambda: c.get(f"/v1/jobs/{results[0][1]}").json()["state"] == "succeeded", 60, "done"
        )


def test_with_gpus_the_largest_job_defaults_to_one_process_per_gpu(tmp_path: Path) -> None:
    # Four GPUs named on a machine with fewer cores: a 4-process job is accepted (the
    # default was the usable CPUs), a 5-process one is not.
    server = LiveServer(tmp_path / "d", "--gpus", "0,1,2,3").start()
    try:
        with server.client() as c:
            four = c.post("/v1/jobs:validate", json=job_spec(nproc=4))
            five = c.post("/v1/jobs:validate", json=job_spec(nproc=5))
        assert four.status_code == 200, four.text
        assert five.status_code == 422 and "at most 4" in five.text
    finally:
        server.stop()
