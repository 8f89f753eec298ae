"""Limits the kernel holds a local job to: its own cgroup caps its memory and processes,
and nothing it started outlives it.

Oracles: the kernel (the job's processes, alive or not, from ``/proc``; a job that touches
more memory than it may is killed), and the job's own report of what it could do. Jobs run
as a real account of their own (``unix_user``), without the sandbox: the case where a
process that leaves its session and environment used to outlive its job.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from isolation_helpers import (
    ALICE,
    JOBS,
    World,
    make_world,
    require_root_and_accounts,
    script_job,
)
from server_helpers import LiveServer, job_end, wait_until

from dmuon_server.launching.cgroups import Cgroups

#: Touches ``argv[1]`` MiB, one page after another.
HUNGRY = r"""
import sys
block = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("touched", len(block) >> 20, "MiB", flush=True)
"""

#: Starts children until the kernel refuses one; reports how many it got.
FORKER = r"""
import os, sys, time
children = []
try:
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
except OSError as e:
    print("refused after", len(children), "children:", e, flush=True)
    sys.exit(3)
print("started", len(children), flush=True)
"""

#: Starts a process that leaves the job's session and environment (setsid, empty env),
#: writes its pid, then sleeps (``argv[1] == "stay"``) or ends at once.
ESCAPE = r"""
import json, os, subprocess, sys, time
from pathlib import Path
child = subprocess.Popen(
    ["/usr/bin/setsid", "/bin/sleep", "600"], env={}, start_new_session=True,
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
out = Path(os.environ["DMUON_CHECKPOINT_DIR"]) / "step_00000001"
out.mkdir(parents=True, exist_ok=True)
time.sleep(0.5)  # setsid forks: report the sleeper itself
pids = [p for p in os.listdir("/proc") if p.isdigit()]
sleepers = [
    int(p) for p in pids
    if Path(f"/proc/{p}/cmdline").exists()
    and Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"/bin/sleep\x00600")
]
(out / "escaped.json").write_text(json.dumps(sleepers))
print("escaped", sleepers, flush=True)
if sys.argv[1] == "stay":
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def cgroups() -> None:
    require_root_and_accounts()
    found, note = Cgroups.detect()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the cgroup tests must run in CI: {note}")
        pytest.skip(note)


@pytest.fixture
def world(cgroups: None) -> Iterator[World]:
    w = make_world({"alice": ALICE})
    for name, text in (("hungry.py", HUNGRY), ("forker.py", FORKER), ("escape.py", ESCAPE)):
        (w.code_root / name).write_text(text)
        (w.code_root / name).chmod(0o644)
    yield w
    shutil.rmtree(w.root, ignore_errors=True)


def _server(world: World, *flags: str) -> LiveServer:
    return LiveServer(
        world.data_dir,
        *("--users-file", str(world.users_file), "--code-root", str(world.code_root)),
        *("--max-nproc", "1", "--max-concurrent-jobs", "2", "--sandbox", "none"),
        *("--job-user", JOBS),
        *("--cancel-grace-s", "2", *flags),
        own_identity=True,
    ).start()


def _alice(world: World, server: LiveServer) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {world.token('alice')}"})


def _submit(client: httpx.Client, script: str, *args: str) -> str:
    r = client.post("/v1/jobs", json=script_job(script, *args, name=script.removesuffix(".py")))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _end(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return job_end(client, job_id)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_job_over_its_memory_or_process_limit_ends_with_that_cause(world: World) -> None:
    server = _server(world, "--max-job-memory", "0.25", "--max-job-pids", "64")
    try:
        log = server.log_path.read_text()
        assert "each job runs in a cgroup v" in log, log[-2000:]
        with _alice(world, server) as alice:
            small = _end(alice, _submit(alice, "hungry.py", "64"))
            assert small["state"] == "succeeded", small  # within the limit
            big = _end(alice, _submit(alice, "hungry.py", "1024"))
            assert big["state"] == "failed", big
            assert big["failure"]["limit"].startswith("the job went beyond its memory limit")
            assert "0.25 GiB (--max-job-memory)" in big["reason"], big["reason"]
            forks = _end(alice, _submit(alice, "forker.py", "200"))
            assert forks["state"] == "failed", forks
            assert "more than 64 processes at once (--max-job-pids)" in forks["failure"]["limit"]
            logs = alice.get(f"/v1/jobs/{forks['id']}/logs").text
            assert "refused after" in logs, logs[-2000:]
    finally:
        server.stop()


def test_a_users_memory_gib_is_their_jobs_limit_at_admission_and_in_the_kernel(
    world: World,
) -> None:
    doc = json.loads(world.users_file.read_text())
    doc["users"][0]["limits"] = {"memory_gib": 0.25}  # alice; the server allows 2 GiB
    world.users_file.write_text(json.dumps(doc))
    server = _server(world, "--max-job-memory", "2")
    try:
        with _alice(world, server) as alice:
            small = _end(alice, _submit(alice, "hungry.py", "64"))
            assert small["state"] == "succeeded", small
            big = _end(alice, _submit(alice, "hungry.py", "1024"))
            assert big["state"] == "failed", big
            assert "0.25 GiB (memory_gib in the users file)" in big["failure"]["limit"], big
            # The recipe's estimate is held to the same limit before anything runs.
            spec = {"nproc_per_node": 1, "train": {"model": "base", "micro_batch_size": 64}}
            r = alice.post("/v1/jobs:validate", json=spec)
            assert r.status_code == 422, r.text
            assert "memory_gib in the users file" in r.text, r.text
    finally:
        server.stop()


def test_no_process_outlives_its_job_or_its_cancel(world: World) -> None:
    server = _server(world)
    try:
        with _alice(world, server) as alice:
            report = "artifacts/checkpoints/step_00000001/escaped.json"
            ended = _end(alice, _submit(alice, "escape.py", "leave"))
            assert ended["state"] == "succeeded", ended
            escaped = json.loads(alice.get(f"/v1/jobs/{ended['id']}/{report}").text)
            assert escaped, "the job did not start its process"
            wait_until(lambda: not any(map(_alive, escaped)), 10, "the detached process to end")

            running = _submit(alice, "escape.py", "stay")
            path = world.data_dir / "jobs" / running / "checkpoints/step_00000001/escaped.json"
            wait_until(path.exists, 60, "the job to start its process", interval=0.2)
            time.sleep(0.2)
            escaped = json.loads(path.read_text())
            assert escaped and all(map(_alive, escaped))
            assert alice.post(f"/v1/jobs/{running}/cancel").status_code == 202
            assert _end(alice, running)["state"] == "cancelled"
            wait_until(lambda: not any(map(_alive, escaped)), 10, "the detached process to end")
    finally:
        server.stop()
