"""Jobs that run a script of their own: ``dmuon.train.log_metrics`` against the server's
reader, the paths a spec may name, and the documentation's example script run through a
live server with two processes, a killed rank and a restart from its checkpoint."""

from __future__ import annotations

import json
import math
import re
import signal
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_helpers import (
    TERMINAL,
    LiveServer,
    fake_recipe_env,
    iter_sse,
    job_spec,
    kill_job_processes,
    processes_of_job,
    wait_until,
)

from dmuon_server.schemas import MetricPoint
from dmuon_server.streams.metrics import parse_lines

DOCS = Path(__file__).resolve().parents[2] / "docs" / "job-service.md"


def docs_script() -> str:
    """The example script of the job-service page (section ``{#scripts}``)."""
    section = DOCS.read_text(encoding="utf-8").split("{#scripts}", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python[^\n]*\n(.*?)```", section, flags=re.DOTALL)
    assert match, "the scripts section has no Python example"
    return match.group(1)


def test_log_metrics_writes_the_contracts_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from dmuon.train import log_metrics

    path = tmp_path / "m.jsonl"
    monkeypatch.delenv("DMUON_METRICS_FILE", raising=False)
    log_metrics(1, loss=1.0)  # outside the service: nothing, and no error
    monkeypatch.setenv("DMUON_METRICS_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    log_metrics(1, loss=1.0)  # not rank 0: nothing
    assert not path.exists()
    monkeypatch.setenv("RANK", "0")
    log_metrics(3, loss=torch.tensor(2.5), lr=0.1, samples=7, spread=float("nan"))
    log_metrics(4, val_loss=2.25)
    for bad, error in ((dict(note="text"), TypeError), (dict(flag=True), TypeError)):
        with pytest.raises(error, match="takes a number"):
            log_metrics(5, **bad)
    with pytest.raises(TypeError, match="whole number"):
        log_metrics(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start at 0"):
        log_metrics(-1)
    chunk = parse_lines(path.read_bytes(), final=True)
    assert not chunk.rejected and [s for s, _ in chunk.points] == [3, 4]
    first = MetricPoint.model_validate(chunk.points[0][1])
    assert (first.loss, first.lr, first.time) == (2.5, 0.1, None)
    assert first.model_extra == {"samples": 7, "spread": "NaN"}
    assert chunk.points[1][1]["val_loss"] == 2.25


@pytest.fixture
def code_root(tmp_path: Path) -> Path:
    """A code root holding the documentation's example script."""
    root = tmp_path / "code"
    root.mkdir()
    (root / "train_script.py").write_text(docs_script())
    return root


def _script(path: str, **more: Any) -> dict[str, Any]:
    return {"nproc_per_node": 1, "script": {"path": path, **more}}


def test_script_paths_outside_the_code_roots_are_refused(
    tmp_path: Path, data_dir: Path, code_root: Path
) -> None:
    outside = tmp_path / "elsewhere.py"
    outside.write_text("print('not yours')\n")
    (code_root / "escape.py").symlink_to(outside)
    (code_root / "pkg").mkdir()
    (code_root / "notes.txt").write_text("x")
    server = LiveServer(data_dir, "--code-root", str(code_root), env=fake_recipe_env()).start()
    try:
        with server.client() as c:
            for path, why in (
                (str(outside), "outside the code roots"),
                ("../elsewhere.py", "outside the code roots"),
                ("escape.py", "outside the code roots"),
                ("missing.py", "does not exist in the code roots"),
                ("pkg", "is a folder"),
                ("notes.txt", "not a Python file"),
            ):
                r = c.post("/v1/jobs", json=_script(path))
                assert r.status_code == 422, (path, r.text)
                assert r.json()["errors"][0]["field"] == "body.script.path", r.text
                assert why in r.json()["detail"] and str(code_root) not in r.text
            both = {**job_spec(1), "script": {"path": "train_script.py"}}
            neither = {"nproc_per_node": 1}
            with_init = {**_script("train_script.py"), "init_from": {"job": "x", "step": 1}}
            for body, why in ((both, "not both"), (neither, "not both"), (with_init, "init_from")):
                r = c.post("/v1/jobs", json=body)
                assert r.status_code == 422 and why in r.text, r.text
            plan = c.post(
                "/v1/jobs:validate", json=_script("train_script.py", args=["--pause", "1"])
            )
            assert plan.status_code == 200, plan.text
            assert plan.json()["argv"][-3:] == ["<code-root>/train_script.py", "--pause", "1"]
            assert plan.json()["admission"] is None
            assert c.get("/v1/jobs").json()["items"] == []
    finally:
        server.stop()
    plain = LiveServer(data_dir, env=fake_recipe_env()).start()
    try:
        with plain.client() as c:
            r = c.post("/v1/jobs", json=_script("train_script.py"))
            assert r.status_code == 422 and "--code-root" in r.json()["detail"]
    finally:
        plain.stop()


def test_the_example_script_streams_to_the_end_and_restarts_after_a_killed_rank(
    data_dir: Path, code_root: Path
) -> None:
    """Two processes of the documentation's script under the service: its metrics stream
    to the end; a rank SIGKILLed after the checkpoint of step 5 costs a restart that
    resumes there, and every step is stored once."""
    steps = 8
    server = LiveServer(data_dir, "--code-root", str(code_root), "--max-nproc", "2").start()
    events: list[Any] = []
    try:
        with server.client() as c:
            spec = {
                "name": "own script",
                "nproc_per_node": 2,
                "max_restarts": 1,
                "script": {"path": "train_script.py", "args": ["--pause", "0.3"], "steps": steps},
            }
            job_id = c.post("/v1/jobs", json=spec).json()["id"]

            def follow() -> None:
                with (
                    server.client(timeout=300) as s,
                    s.stream("GET", f"/v1/jobs/{job_id}/events") as r,
                ):
                    for ev in iter_sse(r):
                        events.append(ev)
                        if ev.event == "end":
                            return

            reader = threading.Thread(target=follow, daemon=True)
            reader.start()
            checkpoint = data_dir / "jobs" / job_id / "checkpoints" / "step_00000005"

            def summary() -> dict:
                return c.get(f"/v1/jobs/{job_id}").json()["summary"]

            wait_until(lambda: checkpoint.is_dir() and (summary()["last_step"] or 0) >= 6, 180,
                       "the checkpoint of step 5")  # fmt: skip
            ranks = {}
            for p in processes_of_job(job_id):
                env = p.environ()
                if "RANK" in env:
                    ranks[env["RANK"]] = (p, env)
            assert sorted(ranks) == ["0", "1"]
            env = ranks["1"][1]
            assert env["DMUON_JOB_ID"] == job_id and env["DMUON_STEPS"] == str(steps)
            assert env["DMUON_METRICS_FILE"].endswith(f"{job_id}/metrics.jsonl")
            assert env["DMUON_CHECKPOINT_DIR"].endswith(f"{job_id}/checkpoints")
            assert "DMUON_RESUME_FROM" not in env
            ranks["1"][0].send_signal(signal.SIGKILL)
            done = wait_until(
                lambda: (lambda j: j if j["state"] in TERMINAL else None)(
                    c.get(f"/v1/jobs/{job_id}").json()
                ),
                240,
                "the job to end",
            )
            assert done["state"] == "succeeded", done
            assert done["summary"]["steps"] == steps and done["summary"]["last_step"] == steps
            causes = [(a["cause"], a["resumed_from_step"]) for a in done["attempts"]]
            assert causes[0] == ("submitted", None) and causes[1][0] == "restart", causes
            # The checkpoint of step 5, or (on a loaded machine, where the kill can come
            # after the last step's save) the final one of step 8.
            assert causes[1][1] in (5, steps) and len(causes) == 2
            points = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
            assert [p["step"] for p in points] == list(range(1, steps + 1))
            assert all(math.isfinite(p["loss"]) and p["samples_per_s"] > 0 for p in points)
            reader.join(timeout=60)
        streamed = [int(e.id) for e in events if e.event == "metric"]
        assert streamed == sorted(set(streamed)) and streamed[-1] == steps  # once, in order
        assert json.loads(events[-1].data)["state"] == "succeeded"
        assert not processes_of_job(job_id) and psutil.pid_exists(server.proc.pid)
    finally:
        server.stop()
        kill_job_processes(data_dir)
