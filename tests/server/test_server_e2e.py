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
