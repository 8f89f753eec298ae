"""Real Unix accounts, a world-readable scratch folder and the take-over script, for the
tests of jobs that run under accounts of their own (local and Slurm)."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from dmuon_server.launching.identity import closed_ancestor

#: The accounts the tests create (system accounts, no home, no login shell).
ALICE, BOB, JOBS = "dmuon-t-alice", "dmuon-t-bob", "dmuon-t-jobs"

#: Run as a job of one user: tries everything the take-over of the server needs, and
#: reading another user's job, and writes what happened into its own checkpoint folder.
TAKEOVER_SCRIPT = r"""
import json
import os
import signal
import sys
from pathlib import Path

server_pid, users_file, other_job = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
data_dir = Path(os.environ["DMUON_SERVER_DATA_DIR"])
out = Path(os.environ["DMUON_CHECKPOINT_DIR"]) / "step_00000001"
out.mkdir(parents=True, exist_ok=True)
report = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}


def attempt(name, action):
    try:
        got = action()
        report[name] = "succeeded" + (f": {sorted(got)}" if isinstance(got, list) else "")
    except Exception as e:
        report[name] = f"{type(e).__name__}: {e}"


def append_admin():
    with open(users_file, "a") as f:
        entry = {"name": "mallory", "token_sha256": "0" * 64, "admin": True}
        f.write(json.dumps({"users": [entry]}))


attempt("read server.json", lambda: (data_dir / "server.json").read_text())
attempt("read the server's environment", lambda: Path(f"/proc/{server_pid}/environ").read_bytes())
attempt("read the users file", lambda: users_file.read_text())
attempt("read the database", lambda: (data_dir / "dmuon-server.sqlite3").read_bytes())
attempt("append an admin to the users file", append_admin)
attempt("signal the server", lambda: os.kill(server_pid, signal.SIGHUP))
attempt("list the jobs", lambda: os.listdir(data_dir / "jobs"))
attempt("list the other job's folder", lambda: os.listdir(data_dir / "jobs" / other_job))
attempt(
    "read the other job's file",
    lambda: (data_dir / "jobs" / other_job / "secret.txt").read_text(),
)
attempt(
    "hard-link the database",
    lambda: os.link(data_dir / "dmuon-server.sqlite3", out / "hardlink_db"),
)
report["server visible in /proc"] = os.path.exists(f"/proc/{server_pid}")
report["processes visible"] = sum(p.isdigit() for p in os.listdir("/proc"))
(out / "report.json").write_text(json.dumps(report))
print("report written", flush=True)
"""

#: A well-behaved job: writes a file of its own and a checkpoint file, and succeeds.
NORMAL_SCRIPT = r"""
import os
from pathlib import Path

Path("secret.txt").write_text("bob's notes")
out = Path(os.environ["DMUON_CHECKPOINT_DIR"]) / "step_00000001"
out.mkdir(parents=True, exist_ok=True)
(out / "weights.bin").write_bytes(b"\x01" * 1024)
print("uid", os.getuid(), flush=True)
"""

#: What each take-over attempt must not do. Two more are judged by their effect: appending
#: to the users file (in a sandbox the path is free, and the job writes a file of its own
#: there: the real file must be unchanged), and listing the jobs (a sandbox shows the job's
#: own folder only: the other job must not be listed).
TAKEOVER_STEPS = (
    "read server.json",
    "read the server's environment",
    "read the users file",
    "read the database",
    "signal the server",
    "list the other job's folder",
    "read the other job's file",
    "hard-link the database",
)


def token_hash(token: str) -> str:
    """What the users file holds for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def require_root_and_accounts() -> None:
    """Skip (fail in CI) unless this process is root and can create accounts."""
    in_ci = os.environ.get("CI") == "true"
    why = None
    if os.geteuid() != 0:
        why = "jobs under accounts of their own need the server to run as root"
    elif shutil.which("useradd") is None:
        why = "useradd is not installed"
    else:
        python = Path(sys.executable)
        closed = closed_ancestor(python) or closed_ancestor(python.resolve())
        if closed is not None:
            why = f"other accounts cannot run {python}: {closed} is not searchable (o+x)"
    if why is not None:
        if in_ci:
            pytest.fail(f"the isolation tests must run in CI: {why}")
        pytest.skip(why)


def ensure_account(name: str) -> int:
    """Create the system account ``name`` if it is missing; return its uid."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(name).pw_uid


@dataclass
class World:
    """A scratch folder every account can pass through, with what the tests need in it."""

    root: Path
    data_dir: Path
    code_root: Path
    users_file: Path
    uids: dict[str, int]

    def token(self, user: str) -> str:
        """The token of service user ``user``."""
        return f"token-of-{user}"


def make_world(users: dict[str, str | None], host_network: frozenset[str] = frozenset()) -> World:
    """A world for service users ``users`` (name -> unix_user or None; those named in
    ``host_network`` may use the host's network): the accounts, a 0755 scratch folder in
    /tmp, a code root holding the scripts and a 0600 users file."""
    uids = {name: ensure_account(name) for name in (ALICE, BOB, JOBS)}
    root = Path(tempfile.mkdtemp(prefix="dmuon-isolation-", dir="/tmp"))
    root.chmod(0o755)
    code = root / "code"
    code.mkdir(mode=0o755)
    code.chmod(0o755)
    for name, text in (("takeover.py", TAKEOVER_SCRIPT), ("normal.py", NORMAL_SCRIPT)):
        (code / name).write_text(text)
        (code / name).chmod(0o644)
    doc = {"users": []}
    for name, unix_user in users.items():
        entry: dict[str, object] = {"name": name, "token_sha256": token_hash(f"token-of-{name}")}
        if unix_user is not None:
            entry["unix_user"] = unix_user
        if name in host_network:
            entry["host_network"] = True
        doc["users"].append(entry)
    users_file = root / "users.json"
    users_file.write_text(json.dumps(doc))
    users_file.chmod(0o600)
    return World(root, root / "data", code, users_file, uids)


def script_job(path: str, *args: str, name: str) -> dict[str, object]:
    """A one-process script job."""
    return {"name": name, "nproc_per_node": 1, "script": {"path": path, "args": list(args)}}
