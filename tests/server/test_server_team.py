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
import threading
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


def test_limits_and_turns_make_the_queue_fair(tmp_path: Path, data_dir: Path) -> None:
    """ada queues many jobs first; bob's next job still starts within the next turn, each
    user's running limit passes over their queued jobs without holding up the others', and
    the users file's queue and priority limits refuse what goes beyond them."""
    users = tmp_path / "users.json"
    users.write_text(
        json.dumps(
            {
                "users": [
                    {"name": "ada", "token_sha256": _hash("t-ada")},
                    {"name": "bob", "token_sha256": _hash("t-bob")},
                    {"name": "root", "token_sha256": _hash("t-root"), "admin": True},
                ],
                "default_limits": {"queued_jobs": 4, "running_jobs": 1, "max_priority": 5},
            }
        )
    )
    os.chmod(users, 0o600)
    env = fake_recipe_env(FAKE_STEP_SECONDS="0.2")
    flags = ("--users-file", str(users), "--max-nproc", "2", "--max-concurrent-jobs", "2")
    server = LiveServer(data_dir, *flags, env=env).start()
    long = {"steps": 100_000}
    try:
        with _as(server, "ada") as ada, _as(server, "bob") as bob, _as(server, "root") as root:
            first = ada.post("/v1/jobs", json=job_spec(1, "a0", **long)).json()["id"]
            _state(ada, first, {"running"})  # the rest wait: ada may run 1 at a time
            a = [ada.post("/v1/jobs", json=job_spec(1, f"a{i}", **long)) for i in range(1, 6)]
            assert [r.status_code for r in a] == [201, 201, 201, 201, 429]
            problem = a[4].json()
            assert problem["type"].endswith("over-limit") and "4 jobs queued" in problem["detail"]
            a_ids = [first] + [r.json()["id"] for r in a[:4]]
            # ada runs 1 of her 1: her next job is passed over, saying why, and does not
            # hold up bob's, which starts in the free slot.
            waiting = _job(ada, a_ids[1])
            assert waiting["state"] == "queued"
            assert waiting["queue_reason"].startswith("ada has 1 of 1 jobs running (their limit)")
            b1 = bob.post("/v1/jobs", json=job_spec(1, "b1", **long)).json()["id"]
            _state(bob, b1, {"running"})
            # Priority above the user's highest: refused; at it: accepted.
            high = bob.post("/v1/jobs", json={**job_spec(1, "b2", **long), "priority": 6})
            assert high.status_code == 403 and "above the highest you may give, 5" in high.text
            # An admin has no default limits.
            r = [root.post("/v1/jobs", json=job_spec(1, f"r{i}", **long)) for i in range(6)]
            assert all(x.status_code == 201 for x in r)
            for job_id in [*a_ids, b1, *(x.json()["id"] for x in r)]:
                assert root.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    finally:
        server.stop()
        kill_job_processes(data_dir)


def test_resume_counts_against_the_queue_limit_like_a_submission(
    tmp_path: Path, data_dir: Path
) -> None:
    """With ``queued_jobs: 2`` a resume that would make a third job wait is refused with 429,
    whoever asks (the job's user or an admin); once a queued job left, it is accepted."""
    users = tmp_path / "users.json"
    users.write_text(
        json.dumps(
            {
                "users": [
                    {"name": "ada", "token_sha256": _hash("t-ada")},
                    {"name": "root", "token_sha256": _hash("t-root"), "admin": True},
                ],
                "default_limits": {"queued_jobs": 2, "running_jobs": 1, "max_priority": 0},
            }
        )
    )
    os.chmod(users, 0o600)
    env = fake_recipe_env(FAKE_STEP_SECONDS="0.05")
    flags = ("--users-file", str(users), "--max-nproc", "2", "--max-concurrent-jobs", "2")
    server = LiveServer(data_dir, *flags, env=env).start()
    long = {"steps": 100_000}
    try:
        with _as(server, "ada") as ada, _as(server, "root") as root:
            short = [ada.post("/v1/jobs", json=job_spec(1, f"s{i}", steps=2)) for i in range(2)]
            done = [r.json()["id"] for r in short]
            for job_id in done:
                assert _state(ada, job_id, TERMINAL)["state"] == "succeeded"
            running = ada.post("/v1/jobs", json=job_spec(1, "run", **long)).json()["id"]
            _state(ada, running, {"running"})
            queued = [ada.post("/v1/jobs", json=job_spec(1, f"q{i}", **long)) for i in range(2)]
            assert [r.status_code for r in queued] == [201, 201]
            for client in (ada, root):
                r = client.post(f"/v1/jobs/{done[0]}/resume", json={"steps": 4})
                assert r.status_code == 429, r.text
                assert "2 jobs queued" in r.json()["detail"]
            assert _job(ada, done[0])["state"] == "succeeded"  # nothing changed
            assert ada.post(f"/v1/jobs/{queued[0].json()['id']}/cancel").status_code == 202
            r = ada.post(f"/v1/jobs/{done[0]}/resume", json={"steps": 4})
            assert r.status_code == 202, r.text
            assert ada.post(f"/v1/jobs/{done[1]}/resume", json={"steps": 4}).status_code == 429
            ids = [running, done[0], *(q.json()["id"] for q in queued)]
            for job_id in ids:
                root.post(f"/v1/jobs/{job_id}/cancel")
    finally:
        server.stop()
        kill_job_processes(data_dir)


def test_a_late_user_waits_one_turn_not_the_whole_queue(tmp_path: Path, data_dir: Path) -> None:
    users = _users_file(tmp_path / "users.json", {"ada": False, "bob": False})
    env = fake_recipe_env(FAKE_STEP_SECONDS="0.2")
    flags = ("--users-file", str(users), "--max-nproc", "2", "--max-concurrent-jobs", "1")
    server = LiveServer(data_dir, *flags, env=env).start()
    long = {"steps": 100_000}
    try:
        with _as(server, "ada") as ada, _as(server, "bob") as bob:
            a = [
                ada.post("/v1/jobs", json=job_spec(1, f"a{i}", **long)).json()["id"]
                for i in range(4)
            ]
            _state(ada, a[0], {"running"})
            b1 = bob.post("/v1/jobs", json=job_spec(1, "b1", **long)).json()
            # Queued: a1, a2, a3, then b1; in turns: a1, b1, a2, a3.
            assert b1["queue_position"] == 2, b1["queue_reason"]
            assert [_job(ada, i)["queue_position"] for i in a[1:]] == [1, 3, 4]
            for job_id in [*a, b1["id"]]:
                c = ada if job_id in a else bob
                assert c.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    finally:
        server.stop()
        kill_job_processes(data_dir)


def test_users_take_turns_within_a_priority() -> None:
    """The policy alone: every user's first job, then every user's second, by priority."""
    from dmuon_server.scheduling.queue_policy import Waiting, fair_order

    users = ["ada", "ada", "ada", "bob", "cy", "bob"]
    names = ["a1", "a2", "a3", "b1", "c1", "b2"]
    queue = [Waiting(n, user=u) for n, u in zip(names, users, strict=True)]
    assert [w.job_id for w in fair_order(queue)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    ranked = [
        Waiting("lo", user="ada"),
        *[Waiting(f"x{i}", priority=3, user="ada") for i in range(2)],
    ]
    assert [w.job_id for w in fair_order(ranked)] == ["x0", "x1", "lo"]


def test_queue_places_are_computed_once_per_change_not_per_request(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading jobs of a long queue does not plan the queue again until something changes
    (the planning rounds are counted)."""
    supervisor = client.app.state.supervisor
    spec = {**job_spec(1, "q", steps=100_000), "gpus_per_node": 0}
    ids = [client.post("/v1/jobs", json=spec).json()["id"] for _ in range(30)]
    real = supervisor._plan
    rounds = []  # those made for requests (the scheduling thread plans on its own)
    scheduler = supervisor._thread

    def counted() -> Any:
        if threading.current_thread() is not scheduler:
            rounds.append(1)
        return real()

    monkeypatch.setattr(supervisor, "_plan", counted)
    supervisor.wake = lambda: None  # no scheduling round in between
    supervisor._cached_places = None
    first = [client.get(f"/v1/jobs/{i}").json()["queue_position"] for i in ids[-3:]]
    client.get("/v1/jobs")
    assert len(rounds) == 1 and all(p is not None for p in first)
    client.post(f"/v1/jobs/{ids[-1]}/cancel")  # a change: the next read plans again
    assert client.get(f"/v1/jobs/{ids[-2]}").json()["queue_position"] == first[1]
    assert len(rounds) == 2
    for job_id in ids:
        client.post(f"/v1/jobs/{job_id}/cancel")


def test_users_charge_only_their_own_slurm_accounts(tmp_path: Path, data_dir: Path) -> None:
    """The users file says which accounts each user may charge; the refusal is a field
    error of ``account`` (here beside the local launcher's own: account is Slurm's)."""
    users = tmp_path / "users.json"
    entries = [
        {"name": "ada", "token_sha256": _hash("t-ada"), "slurm_accounts": ["ml-team"]},
        {"name": "bob", "token_sha256": _hash("t-bob")},
        {"name": "root", "token_sha256": _hash("t-root"), "admin": True},
    ]
    users.write_text(json.dumps({"users": entries}))
    os.chmod(users, 0o600)
    server = LiveServer(data_dir, "--users-file", str(users), env=fake_recipe_env()).start()
    try:

        def refusals(name: str, account: str) -> str:
            with _as(server, name) as c:
                spec = {**job_spec(1, "x", steps=3), "account": account}
                r = c.post("/v1/jobs:validate", json=spec)
                assert r.status_code == 422  # this server has no Slurm either way
                return " ".join(e["message"] for e in r.json()["errors"])

        mine = "is not one you may charge"
        assert mine in refusals("ada", "other-team") and mine in refusals("bob", "ml-team")
        assert mine not in refusals("ada", "ml-team") and mine not in refusals("root", "any")
    finally:
        server.stop()
