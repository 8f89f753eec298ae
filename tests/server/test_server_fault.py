"""Fault test with the REAL recipe: a rank SIGKILLed mid-run, the job restarted from its
latest checkpoint, and the result equal to an uninterrupted run's.

Two jobs of the same spec (2 ranks, ``tiny``, 20 steps, ``checkpoint_every`` 5) run side
by side through a real ``dmuon-server``; in one (``max_restarts`` 1) rank 1 is killed with
SIGKILL as soon as step 7 appears in its metrics file. It must end ``succeeded`` with two
attempts (the second resuming from step 5), report steps 1..20 exactly once (stored and
streamed), and its final checkpoint must hold the same parameters as the other job's,
bit for bit (same world size on CPU: the recipe's resume is exact). The timeline is
printed (``pytest -s``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from server_helpers import (
    LiveServer,
    fault_spec,
    iter_sse,
    metrics_file_steps,
    rank_process,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("checkpointing_recipe")

SPEC = fault_spec(steps=20, warmup_steps=2, checkpoint_every=5, keep_checkpoints=0)


def _stream_steps(url: str, job_id: str, out: list[int]) -> None:
    import httpx

    with (
        httpx.Client(base_url=url, timeout=600) as c,
        c.stream("GET", f"/v1/jobs/{job_id}/events") as resp,
    ):
        for ev in iter_sse(resp):
            if ev.event == "metric":
                out.append(int(ev.id or -1))
            elif ev.event == "end":
                return


def _final_model(ckpt: Path, out: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt, out)
    state = torch.load(out, weights_only=False)
    return state.get("model", state)


def test_a_rank_killed_after_step_7_restarts_and_matches_an_uninterrupted_run(
    data_dir: Path, tmp_path: Path
) -> None:
    import torch

    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    server = LiveServer(data_dir, "--max-concurrent-jobs", "2", "--max-nproc", "2")
    server.env = env
    server.start()
    t0 = time.monotonic()
    timeline: list[str] = []

    def mark(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:7.2f} s  {what}")

    try:
        with server.client(timeout=60) as c:
            faulty = c.post("/v1/jobs", json={**SPEC, "name": "faulty"}).json()["id"]
            reference = c.post(
                "/v1/jobs", json={**SPEC, "name": "reference", "max_restarts": 0}
            ).json()["id"]
            mark("both jobs submitted")
            streamed: list[int] = []
            reader = threading.Thread(target=_stream_steps, args=(server.url, faulty, streamed))
            reader.start()
            metrics = data_dir / "jobs" / faulty / "metrics.jsonl"
            # Found before step 7 (a process scan takes a while on a loaded machine), so
            # the kill follows step 7 at once.
            wait_until(lambda: metrics_file_steps(metrics), 600, "step 1", interval=0.005)
            victim = rank_process(faulty, 1)
            assert victim is not None
            wait_until(lambda: 7 in metrics_file_steps(metrics), 600, "step 7", interval=0.005)
            victim.send_signal(signal.SIGKILL)
            seen = max(metrics_file_steps(metrics))
            mark(f"rank 1 (pid {victim.pid}) SIGKILLed; last step in the file: {seen}")
            assert seen < 10, "the kill came after checkpoint 10; the test needs a slower step"

            def final(job_id: str) -> dict[str, Any] | None:
                job = c.get(f"/v1/jobs/{job_id}").json()
                return job if job["state"] in ("succeeded", "failed", "cancelled") else None

            job = wait_until(lambda: final(faulty), 900, "the faulty job to end", interval=0.5)
            for a in job["attempts"]:
                mark(f"attempt {a['number']} ({a['cause']}) ended: {a['reason']}")
            ref = wait_until(lambda: final(reference), 900, "the reference to end", interval=0.5)
            mark(f"reference {ref['state']}")
            reader.join(timeout=60)
            assert job["state"] == "succeeded", job
            assert ref["state"] == "succeeded", ref
            assert len(job["attempts"]) == 2, job["attempts"]
            first, second = job["attempts"]
            assert first["exit_code"] is not None and first["exit_code"] != 0
            assert second["cause"] == "restart" and second["resumed_from_step"] == 5
            items = c.get(f"/v1/jobs/{faulty}/metrics").json()["items"]
            assert [p["step"] for p in items] == list(range(1, 21))
            assert streamed == sorted(set(streamed)) and set(streamed) == set(range(1, 21))
            ckpts = [k["step"] for k in c.get(f"/v1/jobs/{faulty}/checkpoints").json()["items"]]
            assert ckpts == [5, 10, 15, 20], ckpts
        step20 = Path("checkpoints") / "step_00000020"
        got = _final_model(data_dir / "jobs" / faulty / step20, tmp_path / "faulty.pt")
        want = _final_model(data_dir / "jobs" / reference / step20, tmp_path / "reference.pt")
        assert set(got) == set(want) and got
        worst = max(float((got[k] - want[k]).abs().max()) for k in want)
        mark(f"final parameters: {len(want)} tensors, max |difference| {worst:.3g}")
        print("\n".join(["", *timeline]))
        for k in want:
            assert torch.equal(got[k], want[k]), k
    finally:
        server.stop()
