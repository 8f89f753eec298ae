"""Server-Sent Events against a real uvicorn server (``dmuon-server --port 0``)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import SERVER_TESTS, LiveServer, SSEEvent, iter_sse, job_spec, wait_until


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
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TOKEN"}
    r = subprocess.run(
        [sys.executable, "-m", "dmuon_server.cli", "--host", "0.0.0.0", "--port", "0",
         "--data-dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert r.returncode == 2 and "without a token" in r.stderr


def test_live_server_with_token(server_factory) -> None:
    server = server_factory("--token", "tok-123")
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/v1/jobs").status_code == 401
    ok = httpx.get(server.url + "/v1/jobs", headers={"Authorization": "Bearer tok-123"})
    assert ok.status_code == 200


def test_second_server_on_the_same_data_dir_is_refused(server_factory, data_dir: Path) -> None:
    server_factory()
    other = LiveServer(data_dir, env=_env())
    with pytest.raises(AssertionError, match="another dmuon-server"):
        other.start(timeout=30)


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
