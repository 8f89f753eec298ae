"""Fixtures of the dmuon-server tests: settings, an in-process client, a live server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from server_helpers import SERVER_TESTS, finish_all_jobs, kill_job_processes, make_settings

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
def client(tmp_path: Path, data_dir: Path, fake_env: None) -> Iterator[TestClient]:
    """A client of an in-process app (lifespan running) whose jobs run ``fake_train``."""
    app = create_app(make_settings(tmp_path, data_dir=data_dir))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
        finish_all_jobs(c)
