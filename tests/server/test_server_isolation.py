"""Jobs that cannot become the server: real Unix accounts, bubblewrap, secrets out of the
server's environment, and artifacts served only when the job's account owns them.

Oracles: the kernel (what a job running as another account could open, signal or link,
reported by the job itself), ``/proc`` of the server read from outside, the users file's
bytes before and after, and a real HTTP client against a real server on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from isolation_helpers import (
    ALICE,
    BOB,
    JOBS,
    TAKEOVER_STEPS,
    World,
    make_world,
    require_root_and_accounts,
    script_job,
)
from server_helpers import (
    TERMINAL,
    LiveServer,
    fake_recipe_env,
    job_end,
    job_spec,
    processes_of_job,
    recipe_without_checkpoints,
    wait_until,
)

from dmuon_server.launching import sandbox

pytestmark = pytest.mark.usefixtures("root_and_accounts")

USERS = {"alice": ALICE, "bob": BOB, "carol": None}


@pytest.fixture(scope="module")
def root_and_accounts() -> None:
    require_root_and_accounts()


@pytest.fixture
def world() -> Iterator[World]:
    w = make_world(USERS)
    yield w
    shutil.rmtree(w.root, ignore_errors=True)


def _bwrap_or_skip() -> None:
    why = sandbox.probe(None)
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sandbox tests must run in CI: {why}")
        pytest.skip(why)


def _server(world: World, *flags: str, env: dict[str, str] | None = None) -> LiveServer:
    server = LiveServer(
        world.data_dir,
        "--users-file",
        str(world.users_file),
        "--code-root",
        str(world.code_root),
        "--job-user",
        JOBS,
        "--max-nproc",
        "1",
        "--max-concurrent-jobs",
        "2",
        *flags,
        env=env,
        own_identity=True,
    )
    return server.start()


def _as(world: World, server: LiveServer, user: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {world.token(user)}"})


def _finish(client: httpx.Client, body: dict[str, Any], timeout: float = 120.0) -> dict:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    return job_end(client, job_id, timeout)


def _report(client: httpx.Client, job_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job_id}/artifacts/checkpoints/step_00000001/report.json")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("sandboxed", [False, True], ids=["accounts", "accounts+bwrap"])
def test_a_job_cannot_take_over_the_server_or_read_another_users_job(
    world: World, sandboxed: bool
) -> None:
    if sandboxed:
        _bwrap_or_skip()
    server = _server(world, "--sandbox", "bwrap" if sandboxed else "none")
    users_before = world.users_file.read_bytes()
    try:
        assert server.proc is not None
        with _as(world, server, "bob") as bob, _as(world, server, "alice") as alice:
            normal = _finish(bob, script_job("normal.py", name="bob-normal"))
            assert normal["state"] == "succeeded", normal
            job_dir = world.data_dir / "jobs" / normal["id"]
            assert (job_dir / "secret.txt").stat().st_uid == world.uids[BOB]
            assert job_dir.stat().st_mode & 0o777 == 0o700

            args = (str(server.proc.pid), str(world.users_file), normal["id"])
            takeover = _finish(alice, script_job("takeover.py", *args, name="takeover"))
            assert takeover["state"] == "succeeded", takeover
            report = _report(alice, takeover["id"])
            print(json.dumps(report, indent=1))
            assert report["uid"] == world.uids[ALICE] and report["groups"] in ([], [report["gid"]])
            for step in TAKEOVER_STEPS:
                assert not report[step].startswith("succeeded"), f"a job could {step}"
            assert normal["id"] not in report["list the jobs"]
            if sandboxed:
                assert report["server visible in /proc"] is False
                # Its own folder is the only one there; the server's files are absent.
                assert report["list the jobs"] == f"succeeded: {[takeover['id']]}"
                assert "FileNotFoundError" in report["read the database"]
                assert report["processes visible"] < 10
            # Bob's files are his alone: alice's client sees no such job either.
            assert alice.get(f"/v1/jobs/{normal['id']}/artifacts").status_code == 404

        # The server is untouched: alive, the users file as it was, no new admin.
        assert server.proc.poll() is None
        assert world.users_file.read_bytes() == users_before
        assert world.users_file.stat().st_mode & 0o777 == 0o600
        with server.client(headers={"Authorization": "Bearer " + "0" * 64}) as mallory:
            assert mallory.get("/v1/me").status_code == 401
        for name in ("dmuon-server.sqlite3", "server.json"):
            assert (world.data_dir / name).stat().st_mode & 0o077 == 0, name
        assert world.data_dir.stat().st_mode & 0o777 == 0o711
    finally:
        server.stop()


def test_artifacts_are_served_only_when_the_jobs_account_owns_them_with_one_link(
    world: World,
) -> None:
    server = _server(world, "--sandbox", "none")
    try:
        with _as(world, server, "bob") as bob:
            job = _finish(bob, script_job("normal.py", name="artifacts"))
            assert job["state"] == "succeeded", job
            step = world.data_dir / "jobs" / job["id"] / "checkpoints" / "step_00000001"
            db = world.data_dir / "dmuon-server.sqlite3"
            # What a hostile job (or anyone) could leave among its files: a hard link to the
            # database, a symbolic link to it, and a file of another account.
            os.link(db, step / "hardlink_db")
            os.symlink(db, step / "symlink_db")
            (step / "roots_file").write_text("root's")
            os.symlink(world.data_dir, step / "linked_folder")
            listed = {a["path"] for a in bob.get(f"/v1/jobs/{job['id']}/artifacts").json()["items"]}
            assert "checkpoints/step_00000001/weights.bin" in listed
            for name in ("hardlink_db", "symlink_db", "roots_file", "linked_folder/server.json"):
                assert f"checkpoints/step_00000001/{name}" not in listed
                r = bob.get(f"/v1/jobs/{job['id']}/artifacts/checkpoints/step_00000001/{name}")
                assert r.status_code == 404, (name, r.status_code)
            got = bob.get(f"/v1/jobs/{job['id']}/artifacts/checkpoints/step_00000001/weights.bin")
            assert got.status_code == 200 and got.content == b"\x01" * 1024
            assert got.headers["content-length"] == "1024"
            # The log is the job's (the server opened it for the job, as the job's account).
            log = world.data_dir / "jobs" / job["id"] / "job.log"
            assert log.stat().st_uid == world.uids[BOB]
            assert bob.get(f"/v1/jobs/{job['id']}/artifacts/job.log").status_code == 200
    finally:
        server.stop()


def test_users_without_an_account_run_as_the_job_user_and_the_recipe_runs_sandboxed(
    world: World,
) -> None:
    why = recipe_without_checkpoints()
    if why:
        pytest.skip(why)
    _bwrap_or_skip()
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    server = _server(world, "--sandbox", "bwrap", env=env)
    try:
        with _as(world, server, "carol") as carol:
            recipe = _finish(carol, job_spec(nproc=1, steps=3, name="recipe"), timeout=300)
            assert recipe["state"] == "succeeded", recipe
            points = carol.get(f"/v1/jobs/{recipe['id']}/metrics").json()["items"]
            assert [p["step"] for p in points if p.get("loss") is not None][-1] == 3
            job_dir = world.data_dir / "jobs" / recipe["id"]
            assert job_dir.stat().st_uid == world.uids[JOBS]
            metrics = job_dir / "metrics.jsonl"
            assert metrics.stat().st_uid == world.uids[JOBS]
    finally:
        server.stop()


def _start_failure(*flags: str, user: str | None = None, data_dir: Path) -> str:
    """The error of a server that must refuse to start."""
    cmd = [sys.executable, "-m", "dmuon_server.cli", "--port", "0", "--data-dir", str(data_dir)]
    pre = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user else []
    out = subprocess.run(
        [*pre, *cmd, "--gpus", "none", *flags], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stdout + out.stderr
    return out.stderr


def test_a_server_that_cannot_give_jobs_an_account_says_so(world: World) -> None:
    # Root without an account for jobs: it would run them as root.
    err = _start_failure(data_dir=world.data_dir)
    assert "would run jobs as root" in err and "--job-user" in err
    # An account that does not exist.
    err = _start_failure("--job-user", "no-such-account-here", data_dir=world.data_dir)
    assert "no Unix account 'no-such-account-here'" in err
    # Switching accounts needs root.
    data = world.root / "bob-data"
    data.mkdir()
    shutil.chown(data, BOB, BOB)
    err = _start_failure("--job-user", JOBS, user=BOB, data_dir=data)
    assert "only when the server runs as root" in err


#: Run as another local account against a default server: what it could do without the
#: token, and whether it could read the token.
OTHER_ACCOUNT_SCRIPT = r"""
import json, sys, httpx
url, token_file = sys.argv[1], sys.argv[2]
out = {}
with httpx.Client(base_url=url, timeout=30) as c:
    out["list"] = c.get("/v1/jobs").status_code
    out["submit"] = c.post("/v1/jobs", json={"train": {"model": "tiny"}}).status_code
    out["cancel"] = c.post("/v1/jobs/0123456789abcdef0123456789abcdef/cancel").status_code
try:
    open(token_file).read()
    out["read the token"] = "succeeded"
except OSError as e:
    out["read the token"] = type(e).__name__
print(json.dumps(out))
"""


def _another_account_is_refused(url: str, token_file: Path) -> None:
    """alice, another local account, against bob's default server: 401 everywhere, and the
    token file is out of her reach."""
    out = subprocess.run(
        ["setpriv", f"--reuid={ALICE}", f"--regid={ALICE}", "--clear-groups",
         sys.executable, "-c", OTHER_ACCOUNT_SCRIPT, url, str(token_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got == {"list": 401, "submit": 401, "cancel": 401, "read the token": "PermissionError"}


def test_a_server_running_as_its_users_account_refuses_script_jobs_unless_allowed(
    world: World,
) -> None:
    data = world.root / "bob-data"
    data.mkdir()
    shutil.chown(data, BOB, BOB)
    base = ["setpriv", f"--reuid={BOB}", f"--regid={BOB}", "--clear-groups"]
    for allowed in (False, True):
        flags = ["--code-root", str(world.code_root), "--sandbox", "none", "--gpus", "none"]
        if allowed:
            flags.append("--allow-same-user-jobs")
        proc = subprocess.Popen(
            [*base, sys.executable, "-m", "dmuon_server.cli", "--port", "0",
             "--data-dir", str(data), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            info = wait_until(
                lambda: (
                    json.loads((data / "server.json").read_text())
                    if (data / "server.json").exists()
                    else None
                ),
                60,
                "the server to listen",
            )
            # No auth flag: the server made a token of its own, bob's alone (mode 600).
            token_file = data / "token"
            assert token_file.stat().st_uid == world.uids[BOB]
            assert token_file.stat().st_mode & 0o777 == 0o600
            if not allowed:
                _another_account_is_refused(info["url"], token_file)
            auth = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
            with httpx.Client(base_url=info["url"], timeout=30, headers=auth) as c:
                r = c.post("/v1/jobs:validate", json=script_job("normal.py", name="s"))
                if allowed:
                    assert r.status_code == 200, r.text
                else:
                    assert r.status_code == 422
                    assert "--allow-same-user-jobs" in r.text and BOB in r.text
                # The recipe is the server's own code: it still runs.
                assert c.post("/v1/jobs:validate", json=job_spec(nproc=1)).status_code == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            (data / "server.json").unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["env", "flag"])
def test_secrets_leave_the_servers_environment_and_command_line(world: World, how: str) -> None:
    token = "s3cret-admin-token-value"
    env = {"MY_CLOUD_KEY": "hunter2-cloud"}
    flags: list[str] = ["--secret-env", "MY_CLOUD_KEY", "--sandbox", "none"]
    if how == "env":
        env["DMUON_SERVER_TOKEN"] = token
    else:
        flags += ["--token", token]
    server = _server(world, *flags, env={**os.environ, **env})
    try:
        assert server.proc is not None
        pid = server.proc.pid
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for secret in (token, "hunter2-cloud"):
            assert secret.encode() not in environ and secret.encode() not in cmdline
        with server.client(headers={"Authorization": f"Bearer {token}"}) as admin:
            me = admin.get("/v1/me")
            assert me.status_code == 200 and me.json()["admin"] is True
    finally:
        server.stop()


def test_under_slurm_jobs_run_as_their_users_account_and_cannot_take_over(
    world: World, slurm_cluster: str
) -> None:
    server = _server(world, "--launcher", "slurm", "--sandbox", "none", "--cancel-grace-s", "20")
    users_before = world.users_file.read_bytes()
    try:
        assert server.proc is not None
        with _as(world, server, "bob") as bob, _as(world, server, "alice") as alice:
            normal = _finish(bob, script_job("normal.py", name="slurm-normal"), timeout=180)
            assert normal["state"] == "succeeded", normal
            args = (str(server.proc.pid), str(world.users_file), normal["id"])
            body = script_job("takeover.py", *args, name="slurm-takeover")
            takeover = _finish(alice, body, timeout=180)
            assert takeover["state"] == "succeeded", takeover
            report = _report(alice, takeover["id"])
            print(json.dumps(report, indent=1))
            # Slurm ran it as alice's account: its own view says so, and so does the job.
            slurm = subprocess.run(
                ["scontrol", "show", "job", "--oneliner", str(takeover["slurm_job_id"])],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert f"UserId={ALICE}({world.uids[ALICE]})" in slurm
            assert report["uid"] == world.uids[ALICE]
            for step in TAKEOVER_STEPS:
                assert not report[step].startswith("succeeded"), f"a Slurm job could {step}"
            assert normal["id"] not in report["list the jobs"]
        assert server.proc.poll() is None
        assert world.users_file.read_bytes() == users_before
    finally:
        server.stop()


def test_a_sandboxed_job_is_cancelled_to_its_last_process(world: World) -> None:
    _bwrap_or_skip()
    (world.code_root / "sleeper.py").write_text(
        "import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n"
    )
    (world.code_root / "sleeper.py").chmod(0o644)
    server = _server(world, "--sandbox", "bwrap", "--cancel-grace-s", "5")
    try:
        with _as(world, server, "alice") as alice:
            r = alice.post("/v1/jobs", json=script_job("sleeper.py", name="sleeper"))
            job_id = r.json()["id"]
            wait_until(
                lambda: "sleeping" in alice.get(f"/v1/jobs/{job_id}/logs").text, 60, "it to run"
            )
            procs = processes_of_job(job_id)
            assert procs and all(p.uids().real == world.uids[ALICE] for p in procs)
            assert alice.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
            end = wait_until(
                lambda: (j := alice.get(f"/v1/jobs/{job_id}").json())["state"] in TERMINAL and j,
                60,
                "the cancel",
            )
            assert end["state"] == "cancelled", end
            wait_until(lambda: not processes_of_job(job_id), 10, "every process to end")
    finally:
        server.stop()


def test_a_sandboxed_job_outlives_a_killed_server_and_is_reattached(world: World) -> None:
    """kill -9 of the server mid-job: the sandboxed job goes on (bwrap must not die with
    its parent), and the restarted server follows it to its end."""
    _bwrap_or_skip()
    env = {**os.environ, **fake_recipe_env(FAKE_STEP_SECONDS="0.1")}
    server = _server(world, "--sandbox", "bwrap", env=env)
    try:
        with _as(world, server, "alice") as alice:
            job = alice.post("/v1/jobs", json=job_spec(nproc=1, steps=30)).json()
            wait_until(
                lambda: alice.get(f"/v1/jobs/{job['id']}").json()["state"] == "running",
                60,
                "the job to run",
            )
        server.kill()
        server = _server(world, "--sandbox", "bwrap", env=env)
        with _as(world, server, "alice") as alice:
            end = wait_until(
                lambda: (j := alice.get(f"/v1/jobs/{job['id']}").json())["state"] in TERMINAL and j,
                120,
                "the job to end",
            )
        assert end["state"] == "succeeded", end
        assert end["summary"]["last_step"] == 30
    finally:
        server.stop()
