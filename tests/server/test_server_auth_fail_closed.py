"""Authentication fails closed, through a live server and httpx on loopback.

An empty users file lets nobody in (and a later reload that adds a user does); a
non-loopback ``--host`` with no user refuses to start; an event stream ends once its token
is removed or rotated by a reload; SIGHUP on a server without a users file is logged and
survived. Oracles: HTTP status codes, the stream's events, the process's exit code and log.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from server_helpers import LiveServer, fake_recipe_env, iter_sse, job_spec, wait_until


def _users_file(path: Path, users: dict[str, tuple[str, bool]]) -> Path:
    """``{name: (token, admin)}`` as a users file (mode 600)."""
    doc = {
        "users": [
            {"name": n, "token_sha256": hashlib.sha256(t.encode()).hexdigest(), "admin": a}
            for n, (t, a) in users.items()
        ]
    }
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    return path


def test_an_empty_users_file_lets_nobody_in_until_a_reload_adds_someone(
    tmp_path: Path, data_dir: Path
) -> None:
    users = _users_file(tmp_path / "users.json", {})
    server = LiveServer(data_dir, "--users-file", str(users)).start()
    try:
        with server.client() as anyone:
            assert anyone.get("/v1/jobs").status_code == 401
            assert anyone.get("/v1/me").status_code == 401
            foreign = anyone.get("/v1/jobs", headers={"Host": "evil.example"})
            assert foreign.status_code in (400, 401, 403, 421)
            assert anyone.get("/healthz").status_code == 200
        _users_file(users, {"ada": ("t-ada", False)})
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        with server.client(headers={"Authorization": "Bearer t-ada"}) as ada:
            wait_until(lambda: ada.get("/v1/me").status_code == 200, 10, "the reload")
            assert ada.get("/v1/me").json() == {"name": "ada", "admin": False}
        with server.client() as anyone:
            assert anyone.get("/v1/jobs").status_code == 401
    finally:
        server.stop()


def test_a_non_loopback_host_without_any_user_refuses_to_start(tmp_path: Path) -> None:
    users = _users_file(tmp_path / "users.json", {})
    out = subprocess.run(
        [sys.executable, "-m", "dmuon_server.cli", "--data-dir", str(tmp_path / "d"),
         "--users-file", str(users), "--host", "0.0.0.0", "--port", "0", "--gpus", "none"],
        capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TOKEN"},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "has no users" in out.stderr and "nobody could sign in" in out.stderr


def test_a_stream_ends_when_its_token_is_removed_or_rotated(tmp_path: Path, data_dir: Path) -> None:
    users = _users_file(
        tmp_path / "users.json", {"ada": ("t-ada", False), "root": ("t-root", True)}
    )
    env = fake_recipe_env(FAKE_STEP_SECONDS="0.05")
    server = LiveServer(data_dir, "--users-file", str(users), "--max-nproc", "1", env=env)
    server.start()
    try:
        ada = server.client(headers={"Authorization": "Bearer t-ada"})
        root = server.client(headers={"Authorization": "Bearer t-root"})
        job = ada.post("/v1/jobs", json=job_spec(1, "long", steps=100_000)).json()["id"]
        assert server.proc is not None
        for who, client, change in (
            ("ada", ada, {"root": ("t-root", True)}),  # ada removed
            ("root", root, {"root": ("t-root-2", True)}),  # root's token rotated
        ):
            with client.stream("GET", f"/v1/jobs/{job}/events") as response:
                assert response.status_code == 200
                events = iter_sse(response)
                next(e for e in events if e.event == "metric")  # the job streams
                _users_file(users, change)
                server.proc.send_signal(signal.SIGHUP)
                reloaded = time.monotonic()
                after = [e for e in events if e.event != ":"]
            assert after[-1].event == "end", who
            assert "no longer valid" in after[-1].json()["reason"], who
            # It ended within a few seconds of the reload, not at the job's end.
            assert time.monotonic() - reloaded < 10, who
        with server.client(headers={"Authorization": "Bearer t-root-2"}) as new_root:
            assert new_root.post(f"/v1/jobs/{job}/cancel").status_code == 202
        ada.close()
        root.close()
    finally:
        server.stop()


def test_sighup_without_a_users_file_is_logged_and_survived(data_dir: Path) -> None:
    server = LiveServer(data_dir, "--token", "a-token-of-32-characters-or-more-x").start()
    try:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: "no --users-file to reload" in server.log_path.read_text(), 10, "the log"
        )
        assert server.proc.poll() is None
        headers = {"Authorization": "Bearer a-token-of-32-characters-or-more-x"}
        with server.client(headers=headers) as c:
            assert c.get("/v1/me").json()["admin"] is True
    finally:
        server.stop()
