"""Without the sandbox, each job attempt of a root server gets a /tmp and /dev/shm of its
own: what it writes there is gone when it ends, even when it is killed, and it sees none
of the host's files there but the folders it needs.

Oracles: the job itself, reporting what it sees; the host's /tmp and /dev/shm, listed
after the job was killed; a real server and HTTP client.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from isolation_helpers import script_job
from server_helpers import LiveServer, mount_tmpfs, wait_until

from dmuon_server.launching.job_process import private_tmp_unavailable

#: Fills /tmp and /dev/shm under names the test gives, reports what it sees, then waits
#: to be killed.
FILLER = r"""
import json, os, sys, time
from pathlib import Path

tag, marker, mounted = sys.argv[1], sys.argv[2], sys.argv[3]
for folder in ("/tmp", "/dev/shm"):
    with open(f"{folder}/{tag}", "wb") as f:
        f.write(os.urandom(8 << 20))
report = {
    "tmp": sorted(os.listdir("/tmp")),
    "shm": sorted(os.listdir("/dev/shm")),
    "marker_seen": Path(marker).exists(),
    "mounted_file": Path(mounted).read_text() if Path(mounted).exists() else None,
    "own_folder": os.getcwd(),
}
Path("report.json").write_text(json.dumps(report))
time.sleep(600)
"""


@pytest.fixture
def code_root() -> Iterator[Path]:
    why = private_tmp_unavailable()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the private /tmp test must run in CI: {why}")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="dmuon-private-tmp-", dir="/tmp"))
    (root / "filler.py").write_text(FILLER)
    try:
        # A mount inside a folder the job needs (as a user's volume on a job folder is):
        # it must come along with the folder.
        mount_tmpfs(root / "mounted", 1)
        (root / "mounted" / "inside.txt").write_text("on the mount")
        yield root
    finally:
        subprocess.run(["umount", str(root / "mounted")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_a_killed_job_leaves_nothing_in_tmp_or_dev_shm(tmp_path: Path, code_root: Path) -> None:
    tag = f"dmuon-fill-{secrets.token_hex(6)}"
    marker = Path(tempfile.mkdtemp(prefix="dmuon-host-only-", dir="/tmp")) / "secret"
    marker.write_text("the host's")
    server = LiveServer(tmp_path / "d", "--code-root", str(code_root)).start()
    try:
        with server.client() as c:
            mounted = str(code_root / "mounted" / "inside.txt")
            spec = script_job(str(code_root / "filler.py"), tag, str(marker), mounted,
                              name="filler")  # fmt: skip
            job = c.post("/v1/jobs", json=spec).json()
            folder = tmp_path / "d" / "jobs" / job["id"]
            report_path = folder / "report.json"
            wait_until(report_path.exists, 120, "the job to fill /tmp and /dev/shm")
            report = json.loads(report_path.read_text())
            assert c.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
            wait_until(
                lambda: c.get(f"/v1/jobs/{job['id']}").json()["state"] == "cancelled",
                120,
                "the job to end",
            )
    finally:
        server.stop()
        shutil.rmtree(marker.parent, ignore_errors=True)
    # Inside: its own files, the folders it needs bound back, nothing else of the host's.
    assert tag in report["shm"] and report["shm"] == [tag]
    assert tag in report["tmp"] and not report["marker_seen"]
    assert report["own_folder"] == str(folder.resolve())
    assert marker.parent.name not in report["tmp"]
    assert report["mounted_file"] == "on the mount"
    # Outside, after the kill: nothing left.
    assert not (Path("/tmp") / tag).exists()
    assert not (Path("/dev/shm") / tag).exists()


def test_a_folder_inside_another_is_not_bound_twice(tmp_path: Path) -> None:
    """A checkpoint the job resumes from lies inside its folder: bound on its own it would
    be a mount point the job could not delete when it prunes old checkpoints."""
    from dmuon_server.launching.job_process import with_private_tmp

    outer = Path(tempfile.mkdtemp(prefix="dmuon-keep-", dir="/tmp"))
    try:
        (outer / "checkpoints" / "step_5").mkdir(parents=True)
        argv = with_private_tmp(["true"], None, [outer / "checkpoints" / "step_5", outer])
        count = argv.index("sh", argv.index("-c") + 2) + 1
        assert argv[count : count + 2] == ["1", outer.name]
    finally:
        shutil.rmtree(outer, ignore_errors=True)
