"""Helpers shared by the dmuon-server tests (not fixtures)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import dmuon_recipe_contract as contract
import httpx
import psutil

from dmuon_server.config import DATA_DIR_ENV_MARKER, JOB_ENV_MARKER, Settings

SERVER_TESTS = Path(__file__).resolve().parent
#: How most tests run a server's jobs: as the server's own account (root in CI), without a
#: sandbox; the isolation tests start servers with accounts and bubblewrap of their own.
SAME_USER_JOBS = ("--allow-same-user-jobs", "--sandbox", "none")
T = TypeVar("T")

TERMINAL = {"succeeded", "failed", "cancelled"}


@functools.lru_cache(maxsize=1)
def recipe_without_checkpoints() -> str | None:
    """Why the real recipe cannot run the server's jobs, or None when it can.

    The server passes ``--checkpoint-dir`` and the other checkpoint flags to every job;
    a recipe whose ``--help`` does not list them refuses those jobs.
    """
    if importlib.util.find_spec("dmuon") is None:
        return "the recipe (dmuon) is not installed"
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    out = subprocess.run(
        [sys.executable, "-m", "dmuon.train", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if "--checkpoint-dir" not in out.stdout:
        return (
            "python -m dmuon.train --help lists no --checkpoint-dir "
            "(the checkpointing recipe is not installed yet)"
        )
    return None


def fake_recipe_env(**fake: str) -> dict[str, str]:
    """Environment of a live server whose jobs run ``fake_train`` with the given knobs."""
    pp = os.environ.get("PYTHONPATH")
    return {
        "PYTHONPATH": str(SERVER_TESTS) + (os.pathsep + pp if pp else ""),
        "DMUON_SERVER_TRAIN_MODULE": "fake_train",
        **fake,
    }


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    """Test settings: fake trainer, fast polling, short grace, data root under tmp."""
    kw: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "train_module": "fake_train",
        "poll_interval_s": 0.05,
        "cancel_grace_s": 3.0,
        "heartbeat_s": 15.0,
        "max_nproc_per_node": 4,
        "data_roots": (tmp_path / "datasets",),
        "allowed_hosts": ("testserver",),  # the Host of TestClient
        "allow_same_user_jobs": True,  # script jobs run as the test's own account
        "job_env": ("FAKE_*",),  # the fake recipe's knobs come from the server's env
    }
    kw.update(overrides)
    return Settings(**kw)


def job_spec(nproc: int = 2, name: str | None = None, **train: Any) -> dict[str, Any]:
    """A valid job body; ``train`` overrides recipe settings."""
    t: dict[str, Any] = {
        "model": "tiny",
        "steps": 20,
        "micro_batch_size": 2,
        "accum_steps": 2,
        "seq_len": 32,
        "lr": 0.02,
        "adamw_lr": 0.003,
        "optimizer": "dmuon",
        "mode": "z2",
        "seed": 0,
    }
    t.update(train)
    body: dict[str, Any] = {"nproc_per_node": nproc, "train": t}
    if name is not None:
        body["name"] = name
    return body


def fault_spec(nproc: int = 2, *, max_restarts: int = 1, **train: Any) -> dict[str, Any]:
    """A recipe job the fault tests provoke: the tiny preset, one micro-batch per step, no
    evaluation, restarts allowed; ``train`` overrides recipe settings."""
    body = job_spec(nproc, accum_steps=1, eval_every=0, **train)
    body["max_restarts"] = max_restarts
    return body


def finished_job(c: Any, job_id: str, timeout: float = 60) -> dict[str, Any]:
    """``GET /v1/jobs/{id}`` once the job is in a final state (fails after ``timeout`` s)."""
    return wait_until(
        lambda: (lambda j: j if j["state"] in TERMINAL else None)(
            c.get(f"/v1/jobs/{job_id}").json()
        ),
        timeout,
        f"job {job_id} to finish",
    )


def wait_until(fn: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``fn`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def job_end(client: Any, job_id: str, timeout: float = 120, what: str | None = None) -> Any:
    """The job's record once it is in a terminal state (polled every 0.2 s through
    ``client``); fail after ``timeout`` seconds."""
    return wait_until(
        lambda: (j := client.get(f"/v1/jobs/{job_id}").json())["state"] in TERMINAL and j,
        timeout,
        what or f"job {job_id} to end",
        interval=0.2,
    )


def metrics_file_steps(path: Path) -> list[int]:
    """Steps of the metric points in a job's metrics file, in order (event lines and
    lines that are not JSON left out): the oracle for what the server must have stored."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []  # not written yet
    steps = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(obj, dict) and contract.EVENT_KEY not in obj and "step" in obj:
            steps.append(obj["step"])
    return steps


def fill_disk(path: Path) -> int:
    """Append to ``path`` until its disk refuses; the bytes written."""
    written = 0
    with path.open("ab", buffering=0) as f:
        while True:
            try:
                written += f.write(b"\0" * (64 << 10))
            except OSError:
                return written


def job_processes(data_dir: Path) -> list[psutil.Process]:
    """Live processes of any job started under ``data_dir`` (by their environment marker)."""
    marker = str(Path(os.path.realpath(data_dir)))
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get(DATA_DIR_ENV_MARKER) == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def processes_of_job(job_id: str) -> list[psutil.Process]:
    """Live processes carrying one job's environment marker."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(JOB_ENV_MARKER) == job_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def rank_process(job_id: str, rank: int, program: str = "dmuon.train") -> psutil.Process | None:
    """The process of rank ``rank`` of a job (its ``RANK`` and ``program`` in its command
    line), or None while there is none."""
    for p in processes_of_job(job_id):
        try:
            if p.environ().get("RANK") == str(rank) and program in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    return None


def kill_job_processes(data_dir: Path) -> None:
    """Safety net for teardown: SIGKILL whatever a test left running, and reap the
    children of this test process that ended after their in-process server stopped
    watching them (a real server process would have exited, leaving them to init)."""
    procs = job_processes(data_dir)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)


def finish_all_jobs(client: Any, timeout: float = 60.0) -> None:
    """Cancel every unfinished job of an in-process app and wait until all are final,
    so that the app's supervisor reaps its children before it stops."""
    active = ["queued", "starting", "running"]
    for job in client.get("/v1/jobs", params={"state": active, "limit": 200}).json()["items"]:
        client.post(f"/v1/jobs/{job['id']}/cancel")
    wait_until(
        lambda: not client.get("/v1/jobs", params={"state": active}).json()["items"],
        timeout,
        "every job to finish",
        interval=0.05,
    )


@dataclass
class SSEEvent:
    """One parsed Server-Sent Event (or a comment when ``event == ':'``)."""

    event: str
    data: str
    id: str | None

    def json(self) -> Any:
        """The data as JSON."""
        return json.loads(self.data)


def iter_sse(response: httpx.Response) -> Iterator[SSEEvent]:
    """Parse an event stream; comments come out as events named ``':'``."""
    event, data, eid = "message", [], None
    for line in response.iter_lines():
        if line == "":
            if data:
                yield SSEEvent(event, "\n".join(data), eid)
            event, data, eid = "message", [], None
            continue
        if line.startswith(":"):
            yield SSEEvent(":", line[1:].strip(), None)
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            event = value
        elif field == "data":
            data.append(value)
        elif field == "id":
            eid = value


class LiveServer:
    """``dmuon-server`` as a real process on a free loopback port."""

    def __init__(
        self,
        data_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        own_identity: bool = False,
        default_auth: bool = False,
        cwd: Path | None = None,
    ) -> None:
        """Remember how to start it; :meth:`start` does. Jobs run as the server's account
        without a sandbox (:data:`SAME_USER_JOBS`) unless ``own_identity``: then ``extra``
        says how. Without an auth flag in ``extra`` the server runs ``--no-auth`` unless
        ``default_auth`` (it then makes a token of its own). ``cwd``: the folder it is
        started from (the test's own by default)."""
        self.cwd = cwd
        self.data_dir = data_dir
        self.own_identity = own_identity
        # Tests say which GPUs the server has: none unless they declare some (on a GPU host
        # `--gpus auto` would make jobs wait for devices the test does not know about).
        self.extra = list(extra) if "--gpus" in extra else [*extra, "--gpus", "none"]
        self.extra += ["--job-env", "FAKE_*"]  # the fake recipe's knobs
        self.env = {**os.environ, **(env or {})}
        # A server with no auth flag makes a token of its own: tests that are not about
        # authentication run the explicit single-person mode instead.
        auth_flags = ("--token", "--token-file", "--users-file", "--no-auth", "--token-fd")
        given = any(a.split("=")[0] in auth_flags for a in extra)
        if not (given or default_auth or self.env.get("DMUON_SERVER_TOKEN")):
            self.extra.append("--no-auth")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = data_dir.parent / f"server-{data_dir.name}.log"

    def start(self, timeout: float = 30.0) -> LiveServer:
        """Start the server and wait until /healthz answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        info_path = self.data_dir / "server.json"
        info_path.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dmuon_server.cli",
                    "--port",
                    "0",
                    "--data-dir",
                    str(self.data_dir),
                    *(() if self.own_identity else SAME_USER_JOBS),
                    *self.extra,
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
            )

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                info = json.loads(info_path.read_text())
            except (FileNotFoundError, ValueError):
                return False
            if info.get("pid") != self.proc.pid:
                return False
            self.url = info["url"]
            try:
                return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, "the server to answer /healthz", interval=0.1)
        return self

    def kill(self) -> None:
        """SIGKILL the server (its jobs must survive)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM the server and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def client(self, **kw: Any) -> httpx.Client:
        """An httpx client for this server."""
        return httpx.Client(base_url=self.url, **{"timeout": 30, **kw})


def mount_tmpfs(mount: Path, mib: int, options: str = "") -> None:
    """Mount a tmpfs of ``mib`` MiB (more ``options`` after a comma) on the new folder
    ``mount``; skip the test, saying why, where it cannot be mounted."""
    import pytest

    mount.mkdir()
    extra = f",{options}" if options else ""
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m{extra}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(out.stderr or out.stdout).strip()}")
