"""Fixtures of the dmuon-server tests: settings, an in-process client, a live server."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from fake_launcher import FakeLauncher
from fastapi.testclient import TestClient
from server_helpers import (
    SERVER_TESTS,
    finish_all_jobs,
    kill_job_processes,
    make_settings,
    mount_tmpfs,
    recipe_without_checkpoints,
)

from dmuon_server.app import create_app


@pytest.fixture
def fake_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``fake_train`` importable by jobs and reset its knobs."""
    pp = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(SERVER_TESTS) + (os.pathsep + pp if pp else ""))
    for key in list(os.environ):
        if key.startswith("FAKE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.02")


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh data directory; every job process started under it is killed afterwards."""
    d = tmp_path / "data"
    yield d
    kill_job_processes(d)


@pytest.fixture
def client(real_client: TestClient) -> TestClient:
    """A client of an in-process app (lifespan running) whose jobs run ``fake_train``
    (a module may override it with `fake_client`)."""
    return real_client


@pytest.fixture
def real_client(tmp_path: Path, data_dir: Path, fake_env: None) -> Iterator[TestClient]:
    """A client of an in-process app (lifespan running) whose jobs run ``fake_train``
    under torchrun: their files, logs and the recipe's summary are real."""
    app = create_app(make_settings(tmp_path, data_dir=data_dir))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
        finish_all_jobs(c)


@pytest.fixture
def fake_client(tmp_path: Path, data_dir: Path) -> Iterator[TestClient]:
    """A client of an in-process app whose jobs run no process (`fake_launcher`): for
    routes that need jobs, their points and their ends, but not a real run."""
    app = create_app(make_settings(tmp_path, data_dir=data_dir), make_launcher=FakeLauncher)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
        finish_all_jobs(c)


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """A running one-node Slurm cluster (``.ci/slurm-up.sh``); returns its node name.

    Outside CI the Slurm tests skip, saying why, when Slurm is not installed or cannot be
    started here; in CI (``CI=true``) that is a failure.
    """
    in_ci = os.environ.get("CI") == "true"

    def unavailable(why: str) -> NoReturn:
        if in_ci:
            pytest.fail(f"the Slurm tests must run in CI: {why}")
        pytest.skip(why)

    script = Path(__file__).resolve().parents[2] / ".ci" / "slurm-up.sh"
    if os.geteuid() != 0:
        unavailable(f"starting Slurm needs root ({script} runs munged, slurmctld, slurmd)")
    if not in_ci and shutil.which("slurmctld") is None:
        unavailable(f"Slurm is not installed (run {script} as root, or apt-get install slurm-wlm)")
    try:
        out = subprocess.run([str(script)], capture_output=True, text=True, timeout=360)
    except (OSError, subprocess.TimeoutExpired) as e:
        unavailable(f"{script} did not finish: {e}")
    if out.returncode != 0:
        unavailable(f"{script} could not start Slurm: {(out.stderr or out.stdout)[-2000:]}")
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


#: Size of the ``small_disk`` tmpfs.
SMALL_DISK_MIB = 16


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A ``SMALL_DISK_MIB`` MiB tmpfs, unmounted afterwards (the processes of jobs under its
    ``data`` folder killed first). Mounting needs root: skipped otherwise, saying why."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the full-disk test needs root")
    mount = tmp_path / "small-disk"
    mount_tmpfs(mount, SMALL_DISK_MIB)
    try:
        yield mount
    finally:
        kill_job_processes(mount / "data")
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def checkpointing_recipe() -> None:
    """Skip, saying why, unless the real recipe can run the server's jobs."""
    why = recipe_without_checkpoints()
    if why is not None:
        pytest.skip(why)
