"""End to end with the REAL recipe: ``torchrun -m dmuon.train``, 2 processes, ``tiny``,
accumulation 2, 10 steps, through a real uvicorn server and its event stream."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from server_helpers import LiveServer, iter_sse, job_processes

pytestmark = pytest.mark.usefixtures("checkpointing_recipe")


def test_real_two_process_tiny_job(data_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    server = LiveServer(data_dir)
    server.env = env  # the real recipe: no DMUON_SERVER_TRAIN_MODULE override
    server.start()
    body = {
        "name": "e2e-tiny",
        "nproc_per_node": 2,
        "train": {
            "model": "tiny",
            "steps": 10,
            "micro_batch_size": 2,
            "accum_steps": 2,
            "seq_len": 64,
            "lr": 0.02,
            "adamw_lr": 0.003,
            "optimizer": "dmuon",
            "mode": "z2",
            "seed": 0,
            "eval_every": 0,
        },
    }
    try:
        with server.client(timeout=300) as c:
            plan = c.post("/v1/jobs:validate", json=body).json()
            assert "dmuon.train" in plan["torchrun_argv"]
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            metrics, end = [], None
            with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
                for ev in iter_sse(resp):
                    if ev.event == "metric":
                        metrics.append(ev)
                    elif ev.event == "end":
                        end = ev.json()
                        break
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert end is not None and end["state"] == "succeeded", (
                job,
                c.get(f"/v1/jobs/{job_id}/logs", params={"tail": 60}).json(),
            )
            assert job["state"] == "succeeded" and job["exit_code"] == 0
            assert [int(e.id) for e in metrics] == list(range(1, 11))
            points = [e.json() for e in metrics]
            assert all(p["step"] == i for i, p in enumerate(points, start=1))
            assert all(isinstance(p["loss"], float) and math.isfinite(p["loss"]) for p in points)
            stored = c.get(f"/v1/jobs/{job_id}/metrics").json()
            assert stored["next"] is None
            lines = (data_dir / "jobs" / job_id / "metrics.jsonl").read_text().splitlines()
            from_file = [json.loads(x) for x in lines if x.strip()]
            from_file = [x for x in from_file if isinstance(x.get("step"), int)]
            assert stored["items"] == from_file == points
            assert job["summary"]["last_step"] == 10
    finally:
        server.stop()
    assert not job_processes(data_dir)


def test_a_job_reporting_to_mlflow_lands_in_the_teams_store(data_dir: Path, tmp_path: Path) -> None:
    """The operator points jobs at the team's MLflow store (the server's environment); a job
    asking for MLflow appears there under its name, with the metrics the API serves."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'team-mlflow.db'}"
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    server = LiveServer(data_dir)
    server.env = {**env, "MLFLOW_TRACKING_URI": store, "MLFLOW_EXPERIMENT_NAME": "team"}
    server.start()
    body = {
        "name": "tracked-tiny",
        "nproc_per_node": 1,
        "train": {"model": "tiny", "steps": 3, "seq_len": 32, "micro_batch_size": 2,
                  "eval_every": 0, "report_to": "mlflow,tensorboard"},
    }  # fmt: skip
    try:
        with server.client(timeout=300) as c:
            r = c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
                end = next(ev.json() for ev in iter_sse(resp) if ev.event == "end")
            job = c.get(f"/v1/jobs/{job_id}").json()
            assert end["state"] == "succeeded", c.get(f"/v1/jobs/{job_id}/logs").json()
            points = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
            artifacts = c.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]
    finally:
        server.stop()
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("team")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked-tiny"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert history == {p["step"]: pytest.approx(p["loss"]) for p in points}
    messages = [e["message"] for e in job["events"] if e["kind"] == "trackers"]
    assert messages and f"mlflow run {run.info.run_id}" in messages[0]
    assert "tracking/tensorboard/tracked-tiny" in messages[0] and str(tmp_path) not in messages[0]
    tracking = [a for a in artifacts if a["kind"] == "tracking"]
    assert tracking and all(
        a["path"].startswith("tracking/tensorboard/tracked-tiny/") for a in tracking
    )
