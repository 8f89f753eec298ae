"""A full data directory, through a real ``dmuon-server`` with the REAL recipe.

The server's data directory is a 16 MiB tmpfs (the ``small_disk`` fixture) (root only; skipped
otherwise, saying why). In turn:

1. a job that checkpoints every step fills it: the recipe stops with its checkpoint-write
   error (exit code 4); the job fails with a reason naming the full disk, and is not
   retried although ``max_restarts`` allows it;
2. a second job runs while the test fills the rest of the disk: its recipe dies writing
   its metrics, and neither torchrun's error file nor the runner's exit report can be
   written. The job still ends ``failed`` (never left ``running``) with a reason naming
   the full disk: the server gives back the space it reserved to record it;
3. with the disk full, every read endpoint answers; a submission is refused with a 503
   problem naming the full disk; every metric point in the files is stored;
4. deleting the two jobs frees the space (even though the database could not write the
   deletion before their folders went), and a new job runs and succeeds.

The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import httpx
import pytest
from server_helpers import (
    TERMINAL,
    LiveServer,
    fault_spec,
    fill_disk,
    metrics_file_steps,
    wait_until,
)

from dmuon_server.storage.datadir import RESERVE_FILE, free_bytes

pytestmark = pytest.mark.usefixtures("checkpointing_recipe")

TRAIN = fault_spec(1, warmup_steps=1)["train"]  # each test sets its steps


def test_a_full_data_directory_fails_the_job_and_the_server_keeps_going(
    small_disk: Path,
) -> None:
    data_dir = small_disk / "data"
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    server = LiveServer(data_dir, "--max-concurrent-jobs", "1", "--max-nproc", "1")
    server.env = env
    server.log_path = small_disk.parent / "server.log"  # off the small disk
    server.start()
    t0 = time.monotonic()
    log: list[str] = []

    def mark(what: str) -> None:
        log.append(f"{time.monotonic() - t0:7.2f} s  {what}")

    try:
        with server.client(timeout=60) as c:

            def final(job_id: str) -> dict[str, Any] | None:
                job = c.get(f"/v1/jobs/{job_id}").json()
                return job if job["state"] in TERMINAL else None

            reserve = data_dir / RESERVE_FILE
            wait_until(reserve.exists, 10, "the server to set its reserve aside")
            mark(
                f"reserve {reserve.stat().st_size >> 20} MiB, {free_bytes(data_dir) >> 20} MiB free"
            )

            # 1. Checkpoints every step until the disk is full.
            body = {
                "nproc_per_node": 1,
                "max_restarts": 2,
                "train": {**TRAIN, "steps": 400, "checkpoint_every": 1, "keep_checkpoints": 0},
            }
            filler_job = c.post("/v1/jobs", json=body).json()["id"]
            job = wait_until(lambda: final(filler_job), 300, "the checkpointing job to end", 0.2)
            ckpts = c.get(f"/v1/jobs/{filler_job}/checkpoints").json()["items"]
            mark(f"job 1 {job['state']} after {len(ckpts)} checkpoints: {job['reason']}")
            assert job["state"] == "failed", job
            assert job["exit_code"] == contract.EXIT_CHECKPOINT_WRITE
            assert len(job["attempts"]) == 1, job["attempts"]  # not retried
            assert "could not write a checkpoint" in job["reason"]
            assert "disk is full" in job["reason"] and "No space left" in job["reason"]
            assert ckpts and ckpts[-1]["step"] == len(ckpts)  # the earlier ones are kept
            assert str(data_dir) not in job["reason"]
            # The recipe's checkpoint_failed line is a warning of the job.
            [event] = job["events"]
            assert event["kind"] == contract.CHECKPOINT_FAILED_EVENT
            assert event["level"] == "warning" and event["step"] == len(ckpts) + 1
            assert "No space left on device" in event["message"], event
            folder = data_dir / "jobs" / filler_job
            assert not [p for p in (folder / "checkpoints").iterdir() if p.name.startswith(".")]
            points = c.get(f"/v1/jobs/{filler_job}/metrics").json()["items"]
            assert [p["step"] for p in points] == metrics_file_steps(folder / "metrics.jsonl")

            # 2. A job whose runner cannot write its exit report.
            body = {"nproc_per_node": 1, "train": {**TRAIN, "steps": 100_000}}
            victim = c.post("/v1/jobs", json=body).json()["id"]
            wait_until(lambda: c.get(f"/v1/jobs/{victim}").json()["state"] == "running", 120,
                       "the second job to run")  # fmt: skip
            filler = small_disk / "filler"
            mark(f"job 2 running; the test fills {fill_disk(filler) >> 10} KiB")
            job = wait_until(lambda: final(victim), 120, "the second job to end", 0.1)
            mark(f"job 2 {job['state']}: {job['reason']}")
            assert job["state"] == "failed", job
            assert "disk is full" in job["reason"], job["reason"]
            assert not (data_dir / "jobs" / victim / "exit.json").exists()
            assert not reserve.exists()  # given back to record the outcome
            vpoints = c.get(f"/v1/jobs/{victim}/metrics").json()["items"]
            assert vpoints, "the second job stored no point before the disk filled"
            vfile = metrics_file_steps(data_dir / "jobs" / victim / "metrics.jsonl")
            assert [p["step"] for p in vpoints] == vfile

            # 3. Full: reads answer, a submission gets a 503 naming the disk.
            fill_disk(filler)
            mark(f"disk full again: {free_bytes(data_dir)} bytes free")
            for path in (
                "/healthz",
                "/metrics",
                "/v1/jobs",
                f"/v1/jobs/{victim}",
                f"/v1/jobs/{victim}/metrics",
                f"/v1/jobs/{victim}/logs",
                f"/v1/jobs/{filler_job}/checkpoints",
                f"/v1/jobs/{filler_job}/artifacts",
                "/",
            ):
                assert c.get(path).status_code == 200, path
            refused = c.post("/v1/jobs", json={"nproc_per_node": 1, "train": {**TRAIN, "steps": 2}})
            mark(f"a submission on the full disk: {refused.status_code} {refused.text[:160]}")
            assert refused.status_code == 503, refused.text
            assert refused.headers["content-type"].startswith("application/problem+json")
            assert "disk is full" in refused.json()["detail"]
            assert refused.headers["retry-after"]

            # 4. Deleting the jobs frees the space; a new job runs.
            for job_id in (filler_job, victim):
                gone = c.delete(f"/v1/jobs/{job_id}")
                assert gone.status_code == 204, gone.text
            assert c.get(f"/v1/jobs/{filler_job}").status_code == 404
            mark(f"jobs deleted: {free_bytes(data_dir) >> 20} MiB free")
            body = {"nproc_per_node": 1, "train": {**TRAIN, "steps": 2}}
            fresh = c.post("/v1/jobs", json=body)
            assert fresh.status_code == 201, fresh.text
            job = wait_until(lambda: final(fresh.json()["id"]), 120, "the new job to end", 0.2)
            mark(f"new job {job['state']}")
            assert job["state"] == "succeeded", job
            wait_until(reserve.exists, 10, "the reserve to be taken again")
            health = httpx.get(server.url + "/healthz", timeout=5)
            assert health.status_code == 200
    finally:
        server.stop()
        print("\n".join(["", *log]))
        shutil.rmtree(data_dir / "jobs", ignore_errors=True)
