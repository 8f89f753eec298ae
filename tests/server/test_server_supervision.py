"""Supervision: crashes, cancellation (20 cycles), SIGKILL escalation, FIFO queue,
vanished processes, metrics ingestion edge cases. Jobs run through real torchrun with
``fake_train`` as the recipe (no torch in the workers, so each cycle costs ~1-2 s)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient
from server_helpers import (
    TERMINAL,
    job_processes,
    job_spec,
    make_settings,
    processes_of_job,
    wait_until,
)

from dmuon_server.app import create_app
from dmuon_server.streams.metrics import parse_lines


def _job(c: TestClient, job_id: str) -> dict:
    return c.get(f"/v1/jobs/{job_id}").json()


def _wait_state(c: TestClient, job_id: str, states: set[str], timeout: float = 60) -> dict:
    return wait_until(
        lambda: (lambda j: j if j["state"] in states else None)(_job(c, job_id)),
        timeout,
        f"job {job_id} to reach {states}",
        interval=0.1,
    )


def test_crashing_rank_gives_failed_with_rank_exit_code_and_log(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    monkeypatch.setenv("FAKE_CRASH_RANK", "1")
    monkeypatch.setenv("FAKE_CRASH_STEP", "4")
    monkeypatch.setenv("FAKE_CRASH_CODE", "7")
    monkeypatch.setenv("FAKE_CRASH_MESSAGE", "CUDA-free explosion on rank one")
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.2")
    job = client.post("/v1/jobs", json=job_spec(steps=50)).json()
    done = _wait_state(client, job["id"], TERMINAL)
    assert done["state"] == "failed", done
    assert done["exit_code"] == 7
    f = done["failure"]
    assert f["rank"] == 1 and f["exit_code"] == 7 and f["signal"] is None
    assert "rank 1" in done["reason"] and "7" in done["reason"]
    # The exception the rank recorded in torchrun's error file, not torchrun's boilerplate.
    assert f["error_type"] == "RuntimeError"
    assert f["message"] == "CUDA-free explosion on rank one"
    assert "RuntimeError: CUDA-free explosion on rank one" in done["reason"]
    assert any("CUDA-free explosion on rank one" in line for line in f["log_tail"]), f
    # The log file is named relative to the job's folder, never as a server path.
    assert f["log_file"].startswith("torchrun-logs/") and "/1/" in f["log_file"]
    assert str(data_dir) not in json.dumps(done)
    # Rank 0's points up to the crash are kept.
    assert 1 <= done["summary"]["last_step"] < 50
    assert not job_processes(data_dir)


def test_cancel_cycles_leave_no_process_alive(
    tmp_path: Path, data_dir: Path, fake_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 cycles of: submit, wait for ``running``, cancel, wait for ``cancelled``, in two
    lanes of 10 that run side by side (so a cancel must also leave the other job alone).

    After each cycle no process of the cancelled job may be alive, and at the end none of
    any job: checked with psutil by environment marker, which also finds the torchrun
    workers that live in sessions of their own. The server must have reaped its children.
    """
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.05")
    app = create_app(
        make_settings(tmp_path, data_dir=data_dir, poll_interval_s=0.02, max_concurrent_jobs=2)
    )
    durations: list[float] = []

    def lane(c: TestClient, lane_no: int) -> None:
        for i in range(10):
            job = c.post("/v1/jobs", json=job_spec(steps=100_000, name=f"{lane_no}-{i}")).json()
            _wait_state(c, job["id"], {"running"}, timeout=90)
            assert len(processes_of_job(job["id"])) >= 3  # torchrun + 2 ranks
            t0 = time.monotonic()
            r = c.post(f"/v1/jobs/{job['id']}/cancel")
            assert r.status_code == 202 and r.json()["cancel_requested"] is True
            done = _wait_state(c, job["id"], TERMINAL, timeout=30)
            durations.append(time.monotonic() - t0)
            assert done["state"] == "cancelled", done
            assert [h["state"] for h in done["history"]][-1] == "cancelled"
            left = processes_of_job(job["id"])
            assert not left, [p.cmdline() for p in left]

    with TestClient(app) as c, ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(lane, c, n) for n in range(2)]:
            f.result()
        assert [j["state"] for j in c.get("/v1/jobs", params={"limit": 50}).json()["items"]] == [
            "cancelled"
        ] * 20
        left = job_processes(data_dir)
        assert not left, [p.cmdline() for p in left]
        zombies = [
            (p.pid, p.name())
            for p in psutil.Process().children(recursive=True)
            if p.status() == psutil.STATUS_ZOMBIE
        ]
        assert not zombies
    print(f"cancel -> cancelled: max {max(durations):.2f} s, mean {sum(durations) / 20:.2f} s")


def test_cancel_while_starting_and_queued(tmp_path: Path, data_dir: Path, fake_env: None) -> None:
    app = create_app(make_settings(tmp_path, data_dir=data_dir, poll_interval_s=0.02))
    with TestClient(app) as c:
        first = c.post("/v1/jobs", json=job_spec(steps=100_000)).json()
        second = c.post("/v1/jobs", json=job_spec(steps=100_000)).json()
        _wait_state(c, first["id"], {"starting", "running"})
        # The second waits in the queue and is cancelled without ever starting.
        r = c.post(f"/v1/jobs/{second['id']}/cancel")
        assert r.status_code == 202 and r.json()["state"] == "cancelled"
        assert [h["state"] for h in r.json()["history"]] == ["queued", "cancelled"]
        assert c.post(f"/v1/jobs/{first['id']}/cancel").status_code == 202
        assert _wait_state(c, first["id"], TERMINAL)["state"] == "cancelled"
        assert not job_processes(data_dir)
        # Cancel as soon as the job is starting (torchrun still importing).
        for _ in range(3):
            job = c.post("/v1/jobs", json=job_spec(steps=100_000)).json()
            _wait_state(c, job["id"], {"starting", "running"})
            c.post(f"/v1/jobs/{job['id']}/cancel")
            assert _wait_state(c, job["id"], TERMINAL)["state"] == "cancelled"
            assert not job_processes(data_dir)
        assert not (data_dir / "jobs" / second["id"]).exists()


def test_sigterm_ignoring_ranks_are_killed_after_the_grace_period(
    tmp_path: Path, data_dir: Path, fake_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_IGNORE_SIGTERM", "1")
    app = create_app(make_settings(tmp_path, data_dir=data_dir, cancel_grace_s=1.0))
    with TestClient(app) as c:
        job = c.post("/v1/jobs", json=job_spec(steps=100_000)).json()
        _wait_state(c, job["id"], {"running"})
        t0 = time.monotonic()
        c.post(f"/v1/jobs/{job['id']}/cancel")
        done = _wait_state(c, job["id"], TERMINAL, timeout=40)
        assert done["state"] == "cancelled"
        assert time.monotonic() - t0 >= 1.0  # the grace period was honoured
        assert not job_processes(data_dir)


def test_fifo_queue_with_max_concurrent_jobs(
    tmp_path: Path, data_dir: Path, fake_env: None
) -> None:
    app = create_app(make_settings(tmp_path, data_dir=data_dir, max_concurrent_jobs=1))
    with TestClient(app) as c:
        ids = [c.post("/v1/jobs", json=job_spec(nproc=1, steps=5)).json()["id"] for _ in range(3)]
        seen_running: set[str] = set()

        def all_done() -> bool:
            jobs = c.get("/v1/jobs").json()["items"]  # one consistent snapshot
            active = [j["id"] for j in jobs if j["state"] in ("starting", "running")]
            assert len(active) <= 1, jobs
            seen_running.update(active)
            return all(j["state"] == "succeeded" for j in jobs)

        wait_until(all_done, 120, "three queued jobs to succeed", interval=0.02)
        starts = [_job(c, i)["started_at"] for i in ids]
        assert starts == sorted(starts)  # FIFO
        assert seen_running == set(ids)


def test_killed_launcher_gives_failed_and_no_orphans(client: TestClient, data_dir: Path) -> None:
    """SIGKILL the job's torchrun (the runner): its workers are orphans in sessions of
    their own; the supervisor reports ``failed`` and ends them."""
    job = client.post("/v1/jobs", json=job_spec(steps=100_000)).json()
    _wait_state(client, job["id"], {"running"})
    procs = job_processes(data_dir)
    assert len(procs) >= 3  # runner/torchrun + 2 ranks
    runner = [p for p in procs if "dmuon_server.runner" in " ".join(p.cmdline())]
    assert len(runner) == 1
    workers = [p for p in procs if p.pid != runner[0].pid]
    assert any(os.getsid(w.pid) != os.getsid(runner[0].pid) for w in workers)
    runner[0].send_signal(signal.SIGKILL)
    done = _wait_state(client, job["id"], TERMINAL)
    assert done["state"] == "failed"
    assert "SIGKILL" in done["reason"] and done["exit_code"] == -9
    wait_until(lambda: not job_processes(data_dir), 10, "orphans to be gone")


def test_non_finite_loss_is_encoded(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    monkeypatch.setenv("FAKE_NAN_STEP", "3")
    job = client.post("/v1/jobs", json=job_spec(steps=4)).json()
    assert _wait_state(client, job["id"], TERMINAL)["state"] == "succeeded"
    raw = (data_dir / "jobs" / job["id"] / "metrics.jsonl").read_text()
    assert '"loss": NaN' in raw
    items = client.get(f"/v1/jobs/{job['id']}/metrics").json()["items"]
    assert [p["step"] for p in items] == [1, 2, 3, 4]
    assert items[2]["loss"] == "NaN" and isinstance(items[3]["loss"], float)


def test_partial_last_line_is_taken_when_the_job_ends(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_PARTIAL_TAIL", "1")
    job = client.post("/v1/jobs", json=job_spec(steps=3)).json()
    done = _wait_state(client, job["id"], TERMINAL)
    assert done["state"] == "succeeded" and done["summary"]["points"] == 3
    assert done["recipe_summary"]["steps"] == 3


def test_parse_lines_contract() -> None:
    buf = (
        b'{"step": 1, "loss": 2.5, "new_key": [1]}\n'
        b"garbage\n"
        b'{"step": 2, "loss": Infinity, "lr": "oops"}\n'
        b'{"summary": {"final_loss": 1.0}}\n'
        b'{"step": 3, "loss": 1.'
    )
    chunk = parse_lines(buf, final=False)
    assert [p[0] for p in chunk.points] == [1, 2]
    assert chunk.points[0][1]["new_key"] == [1]
    assert chunk.points[1][1]["loss"] == "Infinity"
    assert chunk.points[1][1]["lr"] is None and chunk.points[1][1]["invalid_lr"] == "oops"
    assert chunk.summary == {"final_loss": 1.0}
    assert [(r.why, r.line) for r in chunk.rejected] == [("not JSON", "garbage")]
    assert chunk.consumed == buf.rfind(b"\n") + 1  # the partial line waits
    json.dumps(chunk.points[1][1], allow_nan=False)  # strict JSON from here on
    final = parse_lines(buf[chunk.consumed :] + b"5}", final=True)
    assert [p[0] for p in final.points] == [3]
