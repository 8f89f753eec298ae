"""The job service against a real one-node Slurm cluster (``dmuon-server --launcher slurm``).

Oracles: Slurm's own view of each job (``scontrol``/``sacct``), the files the jobs wrote,
and the processes left on the node. The timeline (submit -> running, cancel -> cancelled)
is printed for the record, not asserted against a threshold.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_helpers import (
    SERVER_TESTS,
    TERMINAL,
    LiveServer,
    fill_disk,
    iter_sse,
    job_spec,
    make_settings,
    metrics_file_steps,
    processes_of_job,
    rank_process,
    wait_until,
)

from dmuon_server.launching.slurm import SlurmClient
from dmuon_server.storage.datadir import RESERVE_FILE

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def _fake_env(**knobs: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(SERVER_TESTS) + (os.pathsep + pp if pp else "")
    env["DMUON_SERVER_TRAIN_MODULE"] = "fake_train"
    env.update(knobs)
    return env


@pytest.fixture
def servers(data_dir: Path) -> Iterator[list[LiveServer]]:
    """Servers a test starts; stopped afterwards, and their Slurm jobs cancelled."""
    started: list[LiveServer] = []
    yield started
    for s in started:
        s.stop()
    out = subprocess.run(
        ["squeue", "--noheader", "--format=%i %Z"], capture_output=True, text=True
    ).stdout
    mine = [line.split()[0] for line in out.splitlines() if str(data_dir) in line]
    if mine:
        subprocess.run(["scancel", *mine], check=False)


def _start(servers: list[LiveServer], data_dir: Path, env: dict[str, str]) -> LiveServer:
    s = LiveServer(data_dir, "--launcher", "slurm", "--cancel-grace-s", "20", env=env).start()
    servers.append(s)
    return s


def _job(c: httpx.Client, job_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _first_at(job: dict[str, Any], state: str) -> float:
    from datetime import datetime

    at = next(h["at"] for h in job["history"] if h["state"] == state)
    return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()


def _stream_to_end(c: httpx.Client, job_id: str) -> tuple[list[dict[str, Any]], Any]:
    points, end = [], None
    with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        for ev in iter_sse(resp):
            if ev.event == "metric":
                points.append(ev.json())
            elif ev.event == "end":
                end = ev.json()
                break
    return points, end


def _final(c: httpx.Client, job_id: str, timeout: float, what: str) -> dict[str, Any]:
    return wait_until(lambda: (j := _job(c, job_id))["state"] in TERMINAL and j, timeout, what)


def _node_cpus(node: str) -> int:
    out = subprocess.run(["scontrol", "show", "node", "--oneliner", node],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return int(out.split("CPUTot=", 1)[1].split()[0])


def test_slurm_jobs_fail_survive_a_restart_cancel_and_stream_to_the_end(
    data_dir: Path, servers: list[LiveServer], slurm_cluster: str
) -> None:
    """One cluster session, two servers (one spawn of each kind of job):

    1. fake recipe, rank 1 of a 2-process job raises: ``failed`` with Slurm's state, exit
       code and the rank's error;
    2. a long 1-process job survives a SIGKILLed server and is re-attached by its Slurm
       job id; a job that ends while no server runs gets its final state on restart
       (``sacct`` agrees);
    3. cancel: the ranks save a checkpoint, nothing of the job is left on the node;
    4. a 2-process job (tiny, 5 steps, a time limit) pends behind the cancelled job, then
       is streamed over SSE to its end; Slurm records it COMPLETED.

    The jobs run the fake recipe (torchrun, rendezvous and the metrics-file contract are
    real; training is not): the real recipe's start-up costs tens of seconds here, and
    ``test_server_e2e`` runs it through the same server code.
    """
    slurm = SlurmClient()
    fake = _fake_env(
        FAKE_CRASH_RANK="1", FAKE_CRASH_STEP="2", FAKE_CRASH_CODE="5", FAKE_STEP_SECONDS="0.25"
    )
    s1 = _start(servers, data_dir, fake)
    with s1.client() as c:
        t_submit = time.time()
        bad = c.post("/v1/jobs", json=job_spec(2, name="crashes", steps=10)).json()["id"]
        # 1-process jobs have no rank 1: they do not crash. They wait for the 2 CPUs.
        long_id = c.post("/v1/jobs", json=job_spec(1, name="long", steps=2000)).json()["id"]
        # 30 steps of 0.25 s: still running when the server is killed below.
        short_id = c.post("/v1/jobs", json=job_spec(1, name="short", steps=30)).json()["id"]
        failed = _final(c, bad, 120, "the failing job")
        before = wait_until(
            lambda: (j := _job(c, long_id))["summary"]["points"] >= 2 and j, 120, "the long job"
        )
        short_sid = _job(c, short_id)["slurm_job_id"]
    s1.kill()
    t_kill = time.time()

    sid = failed["slurm_job_id"]
    assert failed["state"] == "failed", failed
    assert failed["reason"].startswith(
        f"Slurm job {sid} ended FAILED (exit code 5, NonZeroExitCode): rank 1"
    )
    assert "RuntimeError" in failed["reason"]
    assert failed["failure"]["rank"] == 1 and failed["failure"]["error_type"] == "RuntimeError"
    assert failed["attempts"][0]["slurm_job_id"] == sid
    assert slurm.query(sid).state == "FAILED"  # type: ignore[union-attr]
    long_sid = before["slurm_job_id"]
    assert before["state"] == "running" and long_sid and short_sid
    wait_until(
        lambda: (j := slurm.query_controller(short_sid)) is not None and j.state == "COMPLETED",
        120,
        "the short job to end while no server runs",
    )
    acct = slurm.query_accounting(short_sid)
    assert acct is not None and acct.state == "COMPLETED"

    # Jobs keep the environment they were submitted with: the new server's has no crash.
    s2 = _start(servers, data_dir, _fake_env(FAKE_STEP_SECONDS="0.25"))
    with s2.client(timeout=300) as c:
        short = _final(c, short_id, 30, "the short job")
        assert short["state"] == "succeeded" and short["summary"]["last_step"] == 30
        assert _first_at(short, "succeeded") > t_kill  # learnt after the restart
        after = wait_until(
            lambda: (
                (j := _job(c, long_id))["summary"]["points"] > before["summary"]["points"] and j
            ),
            60,
            "the re-attached job to report new steps",
        )
        assert after["state"] == "running" and after["slurm_job_id"] == long_sid
        assert len(after["attempts"]) == 1
        body = job_spec(2, name="e2e", steps=5, eval_every=0, checkpoint_every=0)
        r = c.post("/v1/jobs", json={**body, "time_limit": "10"})  # pends: it needs both CPUs
        assert r.status_code == 201, r.text
        e2e = r.json()["id"]
        t_cancel = time.time()
        assert c.post(f"/v1/jobs/{long_id}/cancel").status_code == 202
        done = _final(c, long_id, 60, "the cancel")
        t_done = time.time()
        checkpoints = c.get(f"/v1/jobs/{long_id}/checkpoints").json()["items"]
        points, end = _stream_to_end(c, e2e)
        job = _job(c, e2e)
        logs = c.get(f"/v1/jobs/{e2e}/logs", params={"tail": 40}).json()

    assert done["state"] == "cancelled", done
    assert done["reason"].startswith(f"cancelled on request (Slurm job {long_sid} ended")
    # The ranks got SIGTERM and saved: the checkpoint is the last step they reported.
    assert checkpoints and checkpoints[-1]["step"] == done["summary"]["last_step"]
    released = ("COMPLETED", "CANCELLED")
    wait_until(lambda: slurm.query_controller(long_sid).state in released,  # type: ignore[union-attr]
               30, "Slurm to release the job")  # fmt: skip
    assert processes_of_job(long_id) == []
    timeline = (
        f"\nslurm timeline: submit -> running {_first_at(failed, 'running') - t_submit:.1f} s; "
        f"cancel -> cancelled {t_done - t_cancel:.1f} s"
    )
    assert end is not None and end["state"] == "succeeded", (job, logs)
    e2e_sid = job["slurm_job_id"]
    assert job["reason"] == f"Slurm job {e2e_sid} ended COMPLETED (exit code 0)"
    assert any(h["reason"] == f"submitted to Slurm as job {e2e_sid}" for h in job["history"])
    assert [p["step"] for p in points] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(p["loss"]) for p in points)
    if _node_cpus(slurm_cluster) < 3:  # it had to wait for the cancelled job's CPU
        pending = [h["reason"] for h in job["history"] if h["state"] == "queued"]
        assert any(r.startswith(f"Slurm job {e2e_sid} is PENDING") for r in pending), pending
    assert slurm.query(e2e_sid).state == "COMPLETED"  # type: ignore[union-attr]
    assert "--time=10" in (data_dir / "jobs" / e2e / "slurm-attempt-1.sh").read_text()
    print(timeline + f"; 2-process job after the cancel {time.time() - t_done:.1f} s")


def test_a_submission_the_server_did_not_record_is_adopted_not_repeated(tmp_path: Path) -> None:
    """A server that stopped between ``sbatch`` and recording the Slurm job id: the next
    one finds the job by its Slurm job name instead of submitting it again."""
    from dmuon_server.launching.slurm_jobs import SlurmLauncher, job_name
    from dmuon_server.storage.store import Store
    from dmuon_server.streams.metrics import Hub, MetricsTailer

    store = Store(tmp_path / "db.sqlite3")
    store.create_job(
        job_id="adoptme", name=None, nproc=1, spec="{}", spec_hash="x",
        idempotency_key=None, argv=["python"],
    )  # fmt: skip
    store.start_attempt("adoptme", "submitted", None)
    store.create_job(
        job_id="notsent", name=None, nproc=1, spec="{}", spec_hash="y",
        idempotency_key=None, argv=["python"],
    )  # fmt: skip
    store.start_attempt("notsent", "submitted", None)
    out = subprocess.run(
        ["sbatch", "--parsable", f"--job-name={job_name('adoptme')}", "--output=/dev/null",
         "--wrap=sleep 60"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    slurm_id = out.stdout.strip()
    try:
        hub = Hub()
        settings = make_settings(tmp_path, launcher="slurm")
        tailer = MetricsTailer(store, hub)
        SlurmLauncher(settings, store, hub, tailer, lambda *a, **k: True).recover()
        assert store.get_job("adoptme").slurm_job_id == slurm_id  # type: ignore[union-attr]
        assert store.attempts("adoptme")[-1].slurm_job_id == slurm_id
        assert store.get_job("notsent").slurm_job_id is None  # type: ignore[union-attr]
        assert store.attempts("notsent")[-1].finished_at is not None  # submitted anew
    finally:
        subprocess.run(["scancel", slurm_id], check=False)
        store.close()


def test_a_slurm_job_on_a_full_data_directory_fails_naming_the_disk(
    small_disk: Path, servers: list[LiveServer]
) -> None:
    """The data directory is a small tmpfs. While a Slurm job runs, the test fills it: the
    rank dies writing its metrics, the runner cannot write its exit report and the
    server's database cannot take the last points. The job still ends ``failed`` (not
    left ``running``) with a reason naming the full disk: the server gives back its
    reserve to record the end. Every point in the job's file is stored."""
    data_dir = small_disk / "data"
    s = _start(servers, data_dir, _fake_env(FAKE_STEP_SECONDS="0.05"))
    with s.client() as c:
        reserve = data_dir / RESERVE_FILE
        wait_until(reserve.exists, 10, "the server to set its reserve aside")
        spec = job_spec(1, name="fills", steps=100_000)
        submitted = c.post("/v1/jobs", json=spec)
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]
        wait_until(lambda: _job(c, job_id)["summary"]["points"] >= 2, 120, "the job to run")
        filled = fill_disk(small_disk / "filler")
        job = _final(c, job_id, 120, "the job on the full disk to end")
        print(f"filled {filled >> 10} KiB; the job ended: {job['reason']}")
        assert job["state"] == "failed", job
        assert job["reason"].startswith(f"Slurm job {job['slurm_job_id']} ended FAILED")
        assert "disk is full" in job["reason"], job["reason"]
        assert len(job["attempts"]) == 1, job["attempts"]
        assert not reserve.exists()  # given back to record the end
        assert not (data_dir / "jobs" / job_id / "exit.json").exists()
        points = c.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10000}).json()["items"]
        file_steps = metrics_file_steps(data_dir / "jobs" / job_id / "metrics.jsonl")
        assert [p["step"] for p in points] == file_steps and file_steps


def test_a_stopped_rank_of_a_slurm_job_is_killed_when_told_to_end(
    data_dir: Path, servers: list[LiveServer]
) -> None:
    """Rank 1 of a 2-process Slurm job is stopped (SIGSTOP); rank 0 then fails. torchrun
    sends the stopped rank SIGTERM, on which it cannot act, and would SIGKILL it only 30 s
    later; the job's runner on the node kills it at once, so the job fails within a few
    seconds of rank 0's failure."""
    crash_step, step_s = 12, 0.25
    env = _fake_env(
        FAKE_CRASH_RANK="0", FAKE_CRASH_STEP=str(crash_step), FAKE_STEP_SECONDS=str(step_s)
    )
    s = _start(servers, data_dir, env)
    victim: psutil.Process | None = None
    try:
        with s.client() as c:
            job_id = c.post("/v1/jobs", json=job_spec(2, name="stopped", steps=1000)).json()["id"]
            wait_until(lambda: _job(c, job_id)["summary"]["points"] >= 2, 120, "the job to run")
            victim = wait_until(
                lambda: rank_process(job_id, 1, "fake_train"), 30, "rank 1's process"
            )
            victim.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            job = _final(c, job_id, 120, "the job to end")
            seconds = time.monotonic() - stopped_at
            print(f"rank 1 stopped; the job ended {seconds:.1f} s later: {job['reason']}")
            assert job["state"] == "failed", job
            assert job["failure"]["rank"] == 0, job["failure"]
            # Rank 0 fails at most crash_step * step_s after the stop; torchrun's own
            # SIGKILL would come 30 s after that.
            assert seconds < 30, seconds
            job_log = (data_dir / "jobs" / job_id / "job.log").read_text()
            assert f"SIGKILL to rank pid {victim.pid}:" in job_log
            assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
    finally:
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGKILL)
