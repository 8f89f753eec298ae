"""Server restarts: jobs outlive the server, are re-attached, and lose no metric point."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import psutil
from server_helpers import SERVER_TESTS, LiveServer, iter_sse, job_processes, job_spec, wait_until


def _env(**fake: str) -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(SERVER_TESTS) + (os.pathsep + pp if pp else ""),
        "DMUON_SERVER_TRAIN_MODULE": "fake_train",
        **fake,
    }


def _state(c: httpx.Client, job_id: str) -> str:
    return c.get(f"/v1/jobs/{job_id}").json()["state"]


def test_kill_server_mid_job_then_restart(data_dir: Path) -> None:
    env = _env(FAKE_STEP_SECONDS="0.1")
    server = LiveServer(data_dir, "--heartbeat", "0.5", env=env).start()
    steps = 80
    try:
        with server.client() as c:
            job_id = c.post("/v1/jobs", json=job_spec(steps=steps)).json()["id"]
            seen: list[int] = []
            with c.stream("GET", f"/v1/jobs/{job_id}/events") as r:
                for ev in iter_sse(r):
                    if ev.event == "metric":
                        seen.append(int(ev.id))
                        if len(seen) >= 10:
                            break
            runner_pid = c.get(f"/v1/jobs/{job_id}").json()
        before = {p.pid for p in job_processes(data_dir)}
        t_kill = time.monotonic()
        server.kill()
        # The job does not notice: same processes, still writing metrics.
        time.sleep(1.0)
        assert {p.pid for p in job_processes(data_dir)} == before
        assert all(psutil.Process(pid).is_running() for pid in before)
        lines_while_down = len(
            (data_dir / "jobs" / job_id / "metrics.jsonl").read_text().splitlines()
        )
        assert lines_while_down > seen[-1]

        server = LiveServer(data_dir, "--heartbeat", "0.5", env=env).start()
        with server.client() as c:
            assert _state(c, job_id) == "running"
            resumed: list[int] = []
            first_event_at = None
            states: list[str] = []
            with c.stream(
                "GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(seen[-1])}
            ) as r:
                for ev in iter_sse(r):
                    if ev.event == "metric":
                        if first_event_at is None:
                            first_event_at = time.monotonic()
                        resumed.append(int(ev.id))
                    elif ev.event == "state":
                        states.append(ev.json()["state"])
                    elif ev.event == "end":
                        assert ev.json()["state"] == "succeeded"
                        break
            assert first_event_at is not None
            print(f"restart gap (kill -> first resumed event): {first_event_at - t_kill:.2f} s")
            assert seen == list(range(1, len(seen) + 1))
            assert resumed == list(range(seen[-1] + 1, steps + 1))  # no gap, no duplicate
            assert states[-1] == "succeeded"
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] == "succeeded" and job["exit_code"] == 0
            assert "failed" not in [h["state"] for h in job["history"]]
            items = c.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["items"]
            assert [p["step"] for p in items] == list(range(1, steps + 1))
            file_points = [
                json.loads(x)
                for x in (data_dir / "jobs" / job_id / "metrics.jsonl").read_text().splitlines()
                if x.strip() and "step" in json.loads(x)
            ]
            assert items == file_points
        assert runner_pid["state"] == "running"
    finally:
        server.stop()
    assert not job_processes(data_dir)


def test_jobs_that_vanished_or_finished_while_down(data_dir: Path) -> None:
    env = _env(FAKE_STEP_SECONDS="0.05")
    server = LiveServer(data_dir, env=env).start()
    try:
        with server.client() as c:
            doomed = c.post("/v1/jobs", json=job_spec(steps=100_000)).json()["id"]
            wait_until(lambda: _state(c, doomed) == "running", 60, "running")
        server.kill()
        for p in job_processes(data_dir):
            p.kill()
        psutil.wait_procs(job_processes(data_dir), timeout=10)
        server = LiveServer(data_dir, "--max-concurrent-jobs", "1", env=env).start()
        with server.client() as c:
            wait_until(lambda: _state(c, doomed) == "failed", 30, "failed")
            job = c.get(f"/v1/jobs/{doomed}").json()
            assert "vanished" in job["reason"] and "server was down" in job["reason"]
            # A job that finishes while the server is down is recorded from its exit report.
            quick = c.post("/v1/jobs", json=job_spec(steps=30)).json()["id"]
            wait_until(lambda: _state(c, quick) == "running", 60, "running")
        server.stop()  # a graceful stop (SIGTERM) leaves the job running too
        assert job_processes(data_dir)
        wait_until(lambda: not job_processes(data_dir), 60, "the job to end without server")
        server = LiveServer(data_dir, env=env).start()
        with server.client() as c:
            wait_until(lambda: _state(c, quick) == "succeeded", 30, "succeeded")
            items = c.get(f"/v1/jobs/{quick}/metrics").json()["items"]
            assert [p["step"] for p in items] == list(range(1, 31))
    finally:
        server.stop()
