"""What a sandboxed job sees of the server: nothing of its data directory, users file, token
file or working directory, whatever folder the server was started from and whatever code
folder holds them.

Oracle: the job itself, reporting what it could open; the server runs as root with
same-user jobs (the case where only the sandbox stands between a job and those files).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import TERMINAL, LiveServer, wait_until

from dmuon_server.launching import sandbox

#: Reports, for each path given, whether the job could list or read it.
LOOK = r"""
import json, os, sys
from pathlib import Path

report = {}
for path in sys.argv[1:]:
    p = Path(path)
    try:
        report[path] = sorted(os.listdir(p)) if p.is_dir() else p.read_text()
    except OSError as e:
        report[path] = type(e).__name__
out = Path(os.environ["DMUON_CHECKPOINT_DIR"]) / "step_00000001"
out.mkdir(parents=True, exist_ok=True)
(out / "report.json").write_text(json.dumps(report))
"""


@pytest.fixture
def home() -> Iterator[Path]:
    """The operator's folder: the server is started from it, and its data directory and
    users file are in it."""
    why = sandbox.probe(None) if os.geteuid() == 0 else "the server must run as root"
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sandbox tests must run in CI: {why}")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="dmuon-view-", dir="/tmp"))
    code = root / "code"
    code.mkdir()
    (code / "look.py").write_text(LOOK)
    (root / "notes.txt").write_text("the operator's notes")
    users = root / "users.json"
    digest = "a" * 64  # no one signs in with it: the admin uses --token
    users.write_text(json.dumps({"users": [{"name": "ada", "token_sha256": digest}]}))
    users.chmod(0o600)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("code_on_path", [False, True], ids=["started-here", "on-pythonpath"])
def test_a_job_sees_none_of_the_servers_files(home: Path, code_on_path: bool) -> None:
    """Started as ``python -m`` from the folder holding its data directory and users file
    (``sys.path[0]``); with ``on-pythonpath`` that folder is a code folder too (the jobs'
    ``PYTHONPATH``): it is masked all the same, and the code root inside it bound again."""
    data_dir = home / "data"
    env = {"PYTHONPATH": str(home)} if code_on_path else {}
    server = LiveServer(
        data_dir,
        *("--users-file", str(home / "users.json"), "--token", "t-admin"),
        *("--code-root", str(home / "code"), "--sandbox", "bwrap"),
        env=env,
        cwd=home,
    ).start()
    try:
        with server.client(headers={"Authorization": "Bearer t-admin"}) as admin:
            looked_at = [
                str(home),
                str(home / "users.json"),
                str(data_dir),
                str(data_dir / "dmuon-server.sqlite3"),
                str(data_dir / "server.json"),
                str(home / "notes.txt"),
            ]
            body = {"nproc_per_node": 1, "script": {"path": "look.py", "args": looked_at}}
            job_id = admin.post("/v1/jobs", json=body).json()["id"]
            job = wait_until(
                lambda: (j := admin.get(f"/v1/jobs/{job_id}").json())["state"] in TERMINAL and j,
                60,
                "the job to end",
                interval=0.2,
            )
            assert job["state"] == "succeeded", json.dumps(job.get("failure"))
            url = f"/v1/jobs/{job_id}/artifacts/checkpoints/step_00000001/report.json"
            report = admin.get(url).json()
    finally:
        server.stop()
    print(json.dumps(report, indent=1))
    # Only the folders on the way to what is bound (the code root, the job's folder).
    assert report[str(home)] == ["code", "data"]
    assert report[str(data_dir)] == ["jobs"]
    for name in ("users.json", "notes.txt"):
        assert report[str(home / name)] == "FileNotFoundError"
    for name in ("dmuon-server.sqlite3", "server.json"):
        assert report[str(data_dir / name)] == "FileNotFoundError"
