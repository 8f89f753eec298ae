"""A team on one multi-GPU machine, through a live server and httpx, on CPU with declared
GPUs (``--gpus 0,1,2,3``): devices per job read from the processes' environments, the
queue's reasons and priorities, devices coming back after a killed runner and a server
restart; users who cannot see each other's jobs through any endpoint or stream."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import (
    TERMINAL,
    LiveServer,
    fake_recipe_env,
    iter_sse,
    job_spec,
    kill_job_processes,
    processes_of_job,
    wait_until,
)


def _job(c: httpx.Client, job_id: str) -> dict[str, Any]:
    return c.get(f"/v1/jobs/{job_id}").json()


def _state(c: httpx.Client, job_id: str, states: set[str], timeout: float = 60) -> dict:
    return wait_until(
        lambda: (lambda j: j if j["state"] in states else None)(_job(c, job_id)),
        timeout,
        f"job {job_id} to be {states}",
        interval=0.1,
    )


def _devices(job_id: str) -> set[str]:
    """``CUDA_VISIBLE_DEVICES`` of the job's ranks (all must agree), as a set."""
    seen = set()
    for p in processes_of_job(job_id):
        env = p.environ()
        if "RANK" in env:
            assert env["DMUON_JOB_ID"] == job_id
            seen.add(env["CUDA_VISIBLE_DEVICES"])
    assert len(seen) == 1, seen
    return set(seen.pop().split(","))


def test_gpus_are_shared_out_and_the_queue_says_why(data_dir: Path) -> None:
    flags = ("--gpus", "0,1,2,3", "--max-nproc", "8", "--cancel-grace-s", "5")
    env = fake_recipe_env(FAKE_STEP_SECONDS="0.2")
    server = LiveServer(data_dir, *flags, env=env).start()
    long = {"steps": 100_000}
    try:
        with server.client() as c:
            a = c.post("/v1/jobs", json=job_spec(2, "a", **long)).json()["id"]
            b = c.post("/v1/jobs", json=job_spec(2, "b", **long)).json()["id"]
            ja, jb = _state(c, a, {"running"}), _state(c, b, {"running"})
            # Two 2-process jobs at once, on disjoint devices, as their processes see them.
            da, db = _devices(a), _devices(b)
            assert len(da) == len(db) == 2 and not da & db and da | db == {"0", "1", "2", "3"}
            assert {str(g) for g in ja["gpus"]} == da and {str(g) for g in jb["gpus"]} == db
            # A 4-process job waits, saying for what; a small one waits behind it (no
            # backfill); priority 10 goes ahead of both.
            big = c.post("/v1/jobs", json=job_spec(4, "big", **long)).json()
            assert (
                big["queue_position"] == 1 and big["queue_reason"] == "waiting for 4 GPUs: 0 free"
            )
            small = c.post("/v1/jobs", json=job_spec(1, "small", **long)).json()
            assert (small["queue_position"], small["queue_reason"]) == (
                2,
                "waiting for 1 GPU: 0 free, 1 job ahead",
            )
            urgent = c.post("/v1/jobs", json={**job_spec(2, "urgent", **long), "priority": 10})
            assert urgent.json()["queue_position"] == 1
            urgent_id = urgent.json()["id"]
            assert _job(c, big["id"])["queue_reason"] == "waiting for 4 GPUs: 0 free, 1 job ahead"
            with c.stream("GET", f"/v1/jobs/{big['id']}/events") as r:
                first = next(e for e in iter_sse(r) if e.event == "state").json()
            assert (first["state"], first["queue_position"]) == ("queued", 2)
            assert first["queue_reason"].startswith("waiting for 4 GPUs")
            too_many = c.post("/v1/jobs", json=job_spec(5, "too many"))
            assert too_many.status_code == 422, too_many.text
            assert "needs 5 GPUs" in too_many.json()["detail"]
            assert "has 4 (--gpus 0,1,2,3)" in too_many.json()["detail"]
            # kill -9 of a's runner: a ends, its devices come back, and the urgent job
            # (first in the queue) takes them, not the big one behind it.
            runner = next(
                p for p in processes_of_job(a) if "dmuon_server.runner" in " ".join(p.cmdline())
            )
            runner.send_signal(signal.SIGKILL)
            assert _state(c, a, TERMINAL)["state"] == "failed"
            ju = _state(c, urgent_id, {"running"})
            assert {str(g) for g in ju["gpus"]} == da == _devices(urgent_id)
            # Cancelled, b gives its devices back; the big job now waits for 2 more.
            c.post(f"/v1/jobs/{b}/cancel")
            _state(c, b, TERMINAL)
            wait_until(
                lambda: _job(c, big["id"])["queue_reason"] == "waiting for 4 GPUs: 2 free",
                30,
                "b's GPUs",
            )
        # A server restart (kill -9) loses no device: the urgent job keeps its own, the
        # queue stands where it stood.
        server.kill()
        server = LiveServer(data_dir, *flags, env=env).start()
        with server.client() as c:
            assert {str(g) for g in _job(c, urgent_id)["gpus"]} == da == _devices(urgent_id)
            assert _job(c, big["id"])["queue_reason"] == "waiting for 4 GPUs: 2 free"
            assert "dmuon_gpus_busy 2" in c.get("/metrics").text
            c.post(f"/v1/jobs/{urgent_id}/cancel")
            jbig = _state(c, big["id"], {"running"})
            assert jbig["gpus"] == [0, 1, 2, 3] and _devices(big["id"]) == {"0", "1", "2", "3"}
            assert _job(c, small["id"])["queue_reason"] == "waiting for 1 GPU: 0 free"
            for job_id in (big["id"], small["id"]):
                c.post(f"/v1/jobs/{job_id}/cancel")
            _state(c, big["id"], TERMINAL)
            assert "dmuon_gpus_busy 0" in c.get("/metrics").text
    finally:
        server.stop()
        kill_job_processes(data_dir)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _users_file(path: Path, users: dict[str, bool], mode: int = 0o600) -> Path:
    doc = {
        "users": [
            {"name": n, "token_sha256": _hash(f"t-{n}"), "admin": a} for n, a in users.items()
        ]
    }
    path.write_text(json.dumps(doc))
    os.chmod(path, mode)
    return path


@pytest.fixture
def team(tmp_path: Path, data_dir: Path) -> Iterator[tuple[LiveServer, Path]]:
    users = _users_file(tmp_path / "users.json", {"ada": False, "bob": False, "root": True})
    env = fake_recipe_env(FAKE_STEP_SECONDS="0.2")
    flags = ("--users-file", str(users), "--max-nproc", "2", "--max-concurrent-jobs", "2")
    server = LiveServer(data_dir, *flags, env=env).start()
    yield server, users
    server.stop()
    kill_job_processes(data_dir)


def _as(server: LiveServer, name: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer t-{name}"})


def test_users_see_only_their_own_jobs(team: tuple[LiveServer, Path]) -> None:
    server, users = team
    with _as(server, "ada") as ada, _as(server, "bob") as bob, _as(server, "root") as root:
        a = ada.post(
            "/v1/jobs", json=job_spec(1, "ada's", steps=100_000), headers={"Idempotency-Key": "k"}
        )
        b = bob.post(
            "/v1/jobs", json=job_spec(1, "bob's", steps=3), headers={"Idempotency-Key": "k"}
        )
        assert a.status_code == b.status_code == 201  # one key, two users: two jobs
        a_id, b_id = a.json()["id"], b.json()["id"]
        assert a.json()["user"] == "ada" and b.json()["user"] == "bob"
        _state(bob, b_id, TERMINAL)
        # ada's job does not exist for bob, through any endpoint or stream.
        for method, path in (
            ("GET", f"/v1/jobs/{a_id}"),
            ("GET", f"/v1/jobs/{a_id}/events"),
            ("GET", f"/v1/jobs/{a_id}/metrics"),
            ("GET", f"/v1/jobs/{a_id}/logs"),
            ("GET", f"/v1/jobs/{a_id}/checkpoints"),
            ("POST", f"/v1/jobs/{a_id}/cancel"),
            ("POST", f"/v1/jobs/{a_id}/resume"),
            ("DELETE", f"/v1/jobs/{a_id}"),
        ):
            r = bob.request(method, path)
            assert r.status_code == 404, (method, path, r.status_code)
            assert r.json()["detail"] == f"no job with id {a_id!r}; list jobs with GET /v1/jobs"
        assert [j["id"] for j in bob.get("/v1/jobs").json()["items"]] == [b_id]
        assert bob.get("/v1/jobs", params={"user": "ada"}).json()["items"] == []
        init = {**job_spec(1, steps=2), "init_from": {"job": a_id, "step": "latest"}}
        r = bob.post("/v1/jobs:validate", json=init)
        assert r.status_code == 422 and f"there is no job {a_id!r}" in r.json()["detail"]
        # The same key again: each user gets their own job back.
        again = ada.post(
            "/v1/jobs", json=job_spec(1, "ada's", steps=100_000), headers={"Idempotency-Key": "k"}
        )
        assert again.status_code == 200 and again.json()["id"] == a_id
        # The admin sees both, and filters by user.
        assert {j["id"] for j in root.get("/v1/jobs").json()["items"]} == {a_id, b_id}
        assert [j["id"] for j in root.get("/v1/jobs", params={"user": "ada"}).json()["items"]] == [
            a_id
        ]
        assert root.get(f"/v1/jobs/{a_id}/logs").status_code == 200
        assert bob.get("/v1/me").json() == {"name": "bob", "admin": False}
        assert root.get("/v1/me").json() == {"name": "root", "admin": True}
        assert bob.get("/v1/users").status_code == 403
        assert {u["name"] for u in root.get("/v1/users").json()["items"]} == {"ada", "bob", "root"}
        assert server.client().get("/v1/jobs").status_code == 401
        assert (
            server.client(headers={"Authorization": "Bearer t-eve"}).get("/v1/jobs").status_code
            == 401
        )
        # SIGHUP reloads the file: bob leaves, carol joins; a broken file changes nothing.
        _users_file(users, {"ada": False, "carol": False, "root": True})
        server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        wait_until(lambda: bob.get("/v1/jobs").status_code == 401, 10, "the reload")
        with _as(server, "carol") as carol:
            assert carol.get("/v1/jobs").json()["items"] == []
            users.write_text("{broken")
            server.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            wait_until(lambda: "users not reloaded" in server.log_path.read_text(), 10, "the log")
            assert carol.get("/v1/jobs").status_code == 200
        assert root.post(f"/v1/jobs/{a_id}/cancel").status_code == 202  # an admin cancels any


def test_a_users_file_others_can_read_stops_the_server(tmp_path: Path) -> None:
    users = _users_file(tmp_path / "users.json", {"ada": False}, mode=0o644)
    out = subprocess.run(
        [sys.executable, "-m", "dmuon_server.cli", "--data-dir", str(tmp_path / "d"),
         "--users-file", str(users), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "readable or writable by other users" in out.stderr and "chmod 600" in out.stderr
