"""A hung rank, through a real ``dmuon-server`` with the REAL recipe.

A 2-process job (``collective_timeout`` 20 s, ``max_restarts`` 1) has rank 1 stopped with
SIGSTOP after step 3: rank 0 waits in a collective, fails after the timeout with the
recipe's ``StepFailed``; torchrun sends the stopped rank SIGTERM, on which it cannot act
until continued, and would wait 30 s before its SIGKILL: the job's runner kills it at
once (`dmuon_server.launching.procs.kill_stopped_ranks`), and the attempt ends as a failure that
``max_restarts`` covers.
The restarted attempt resumes from the last checkpoint and the job succeeds with every
step once. The seconds from SIGSTOP to the job leaving ``running`` are printed
(``pytest -s``) and bounded: rank 0 meets the timeout in up to two collectives (the
step's and the one its failure runs into), plus a margin well under torchrun's 30 s.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import (
    TERMINAL,
    LiveServer,
    fault_spec,
    metrics_file_steps,
    rank_process,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("checkpointing_recipe")

#: Long enough for every collective of a loaded 2-core machine (startup included): at
#: 6 s, a load average of 14 timed out the start of both attempts.
TIMEOUT_S = 20
SPEC = fault_spec(steps=8, warmup_steps=1, checkpoint_every=2, collective_timeout=TIMEOUT_S)


def test_a_stopped_rank_fails_the_attempt_and_the_restart_succeeds(data_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
    server = LiveServer(data_dir, "--max-nproc", "2")
    server.env = env
    server.start()
    victim: psutil.Process | None = None
    try:
        with server.client(timeout=60) as c:
            job_id = c.post("/v1/jobs", json=SPEC).json()["id"]
            metrics = data_dir / "jobs" / job_id / "metrics.jsonl"
            wait_until(lambda: 3 in metrics_file_steps(metrics), 300, "step 3", interval=0.01)
            victim = rank_process(job_id, 1)
            assert victim is not None
            victim.send_signal(signal.SIGSTOP)
            stopped_at = time.time()
            seen = max(metrics_file_steps(metrics))

            def final() -> dict[str, Any] | None:
                job = c.get(f"/v1/jobs/{job_id}").json()
                return job if job["state"] in TERMINAL else None

            job = wait_until(final, 300, "the job to end", interval=0.5)
            assert job["state"] == "succeeded", [a["reason"] for a in job["attempts"]]
            first, second = job["attempts"]
            assert second["cause"] == "restart"
            assert first["exit_code"] not in (None, 0)
            # rank 0 timed out in a collective; the stopped rank was killed, not left.
            assert "StepFailed" in first["reason"], first["reason"]
            assert second["resumed_from_step"] is not None
            assert second["resumed_from_step"] <= seen
            assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
            left = next(
                h for h in job["history"] if h["state"] == "starting" and "restart" in h["reason"]
            )
            detected = datetime.fromisoformat(left["at"].replace("Z", "+00:00")).timestamp()
            seconds = detected - stopped_at
            print(
                f"\nrank 1 stopped after step {seen}; the job left running {seconds:.1f} s "
                f"later (collective timeout {TIMEOUT_S} s); attempt 1: {first['reason'][:200]}"
            )
            assert TIMEOUT_S <= seconds < 2 * TIMEOUT_S + 25
            # The runner killed the stopped rank, not torchrun's SIGKILL 30 s later.
            job_log = (data_dir / "jobs" / job_id / "job.log").read_text()
            assert f"SIGKILL to rank pid {victim.pid}:" in job_log
            items = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
            assert [p["step"] for p in items] == list(range(1, 9))
    finally:
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGKILL)
        server.stop()


def test_only_a_stopped_process_told_to_end_is_killed() -> None:
    """The watchdog's rule, against the kernel's own view of a process: running, stopped,
    and stopped with SIGTERM pending (only the last is killed)."""
    import subprocess
    import sys

    from dmuon_server.launching.procs import kill_stopped_ranks, stopped_and_told_to_end

    parent = psutil.Process()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        p = psutil.Process(child.pid)
        assert not stopped_and_told_to_end(p)
        p.send_signal(signal.SIGSTOP)
        wait_until(lambda: p.status() == psutil.STATUS_STOPPED, 10, "the child to stop")
        assert not stopped_and_told_to_end(p) and kill_stopped_ranks(parent) == []
        p.send_signal(signal.SIGTERM)  # pending: a stopped process does not act on it
        time.sleep(0.2)
        assert p.status() == psutil.STATUS_STOPPED and stopped_and_told_to_end(p)
        assert kill_stopped_ranks(parent) == [child.pid]
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait(timeout=10)
