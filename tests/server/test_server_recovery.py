"""Start-up recovery edge cases (in-process), and the demo's settings and client."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient
from server_helpers import SERVER_TESTS, job_spec, make_settings, processes_of_job, wait_until

from dmuon_server.app import create_app
from dmuon_server.schemas import JobCreate
from dmuon_server.storage.store import Store


def _insert(store: Store, state: str, **cols: object) -> str:
    spec = JobCreate.model_validate(job_spec(steps=5)).model_dump_json()
    job_id = hashlib.sha1(os.urandom(8)).hexdigest()
    store.create_job(
        job_id=job_id,
        name=None,
        nproc=2,
        spec=spec,
        spec_hash="x",
        idempotency_key=None,
        argv=["true"],
    )
    store.transition(job_id, state, "set up by the test", **cols)
    return job_id


def test_reused_pid_is_not_mistaken_for_the_job(tmp_path: Path, data_dir: Path) -> None:
    """A job whose recorded pid now belongs to another process (here: this very test
    process, with another create time) is recognised as gone, and nothing is killed."""
    settings = make_settings(tmp_path, data_dir=data_dir)
    store = Store(settings.db_path)
    me = psutil.Process()
    reused = _insert(
        store, "running", pid=me.pid, pgid=os.getpgid(0), create_time=me.create_time() - 1000
    )
    launching = _insert(store, "starting")  # the old server died before recording a pid
    with TestClient(create_app(settings)) as c:
        job = wait_until(
            lambda: (lambda j: j if j["state"] == "failed" else None)(
                c.get(f"/v1/jobs/{reused}").json()
            ),
            10,
            "the orphaned job to fail",
        )
        assert "vanished" in job["reason"]
        job = c.get(f"/v1/jobs/{launching}").json()
        assert job["state"] == "failed" and "launching" in job["reason"]
    assert me.is_running()


def test_demo_settings_match_the_recipe() -> None:
    """``dmuon_server.demo`` mirrors ``dmuon.train.DEMO_ARGS`` without importing dmuon."""
    pytest.importorskip("dmuon.train", reason="dmuon.train (the real recipe) is not installed")
    from dmuon.train import TrainConfig, parse_args
    from dmuon.train.demo import DEMO_ARGS, DEMO_NPROC
    from dmuon_server.demo import DEMO_NPROC as SERVER_NPROC
    from dmuon_server.demo import DEMO_TRAIN

    assert SERVER_NPROC == DEMO_NPROC
    recipe = parse_args(list(DEMO_ARGS))
    for key, value in DEMO_TRAIN.items():
        if key == "lr":
            assert value == recipe.effective_lr
        else:
            assert getattr(recipe, key) == value, key
    assert isinstance(recipe, TrainConfig)


def test_demo_client_end_to_end_with_the_fake_recipe(tmp_path: Path) -> None:
    pp = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": str(SERVER_TESTS) + (os.pathsep + pp if pp else ""),
        "DMUON_SERVER_TRAIN_MODULE": "fake_train",
        "FAKE_STEP_SECONDS": "0.02",
    }
    data = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "dmuon_server.demo", "--steps", "40", "--data-dir", str(data)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "torchrun command:" in out and "--accum-steps 4" in out
    assert "result: succeeded" in out
    assert "validation loss: start 5.0000" in out and "server stopped" in out
    assert "train: 100%" in r.stderr  # the tqdm bar reached the end
    kept = out.split("the run's folder is kept: ")[1].split("\n")[0]
    folder = Path(kept.split(" (")[0])
    assert folder.parent == data / "jobs" and (folder / "metrics.jsonl").is_file()
    # It names what is there, and only that (no export folder the run did not make).
    listed = kept.split(" (", 1)[1].removesuffix(")").split(", ")
    there = sorted(e.name + ("/" if e.is_dir() else "") for e in folder.iterdir())
    assert listed == [name for name in there if not name.startswith(".")], (listed, there)
    info = json.loads((data / "server.json").read_text())
    assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == "zombie"


def test_pending_cancel_survives_a_restart(
    tmp_path: Path, data_dir: Path, fake_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancel a job whose ranks ignore SIGTERM, stop the server inside the grace period;
    the next server re-attaches, sees the pending cancel and finishes it with SIGKILL."""
    monkeypatch.setenv("FAKE_IGNORE_SIGTERM", "1")
    first = create_app(make_settings(tmp_path, data_dir=data_dir, cancel_grace_s=60))
    with TestClient(first) as c:
        job_id = c.post("/v1/jobs", json=job_spec(steps=100_000)).json()["id"]
        wait_until(lambda: c.get(f"/v1/jobs/{job_id}").json()["state"] == "running", 60, "running")
        assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    # The first server is gone; the job still runs (its ranks ignored the SIGTERM).
    assert processes_of_job(job_id)
    second = create_app(make_settings(tmp_path, data_dir=data_dir, cancel_grace_s=0.5))
    with TestClient(second) as c:
        job = wait_until(
            lambda: (lambda j: j if j["state"] == "cancelled" else None)(
                c.get(f"/v1/jobs/{job_id}").json()
            ),
            30,
            "the cancel to complete after the restart",
        )
        assert job["cancel_requested"] is True
    assert not processes_of_job(job_id)
