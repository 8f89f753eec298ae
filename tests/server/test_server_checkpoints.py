"""Checkpoints, restarts, resume and init_from through the job service, with ``fake_train``
as the recipe (it follows the checkpoint contract: ``step_XXXXXXXX`` folders, ``--resume
auto``, SIGTERM -> save + ``stopped`` line + exit 0; see its docstring).

The oracle for the trained "weight" is the fake's update rule replayed here
(``w <- 0.9 w + 0.01 step`` from ``w = seed``): a run that was killed, cancelled or resumed
must end with the weight of one uninterrupted run.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import pytest
from fastapi.testclient import TestClient
from server_helpers import TERMINAL, job_spec, make_settings, wait_until

from dmuon_server.app import create_app
from dmuon_server.cli import build_parser
from dmuon_server.streams.metrics import parse_lines


def _weight(seed: int, steps: int) -> float:
    w = float(seed)
    for step in range(1, steps + 1):
        w = w * 0.9 + step * 0.01
    return w


def _job(c: TestClient, job_id: str) -> dict[str, Any]:
    return c.get(f"/v1/jobs/{job_id}").json()


def _wait_state(c: TestClient, job_id: str, states: set[str], timeout: float = 90) -> dict:
    return wait_until(
        lambda: (lambda j: j if j["state"] in states else None)(_job(c, job_id)),
        timeout,
        f"job {job_id} to reach {states}",
        interval=0.05,
    )


def _points(c: TestClient, job_id: str) -> list[dict[str, Any]]:
    return c.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10_000}).json()["items"]


def _saved_weight(data_dir: Path, job_id: str, step: int) -> float:
    state = data_dir / "jobs" / job_id / "checkpoints" / f"step_{step:08d}" / "state.json"
    return json.loads(state.read_text())["weight"]


def _stream_steps(c: TestClient, job_id: str, out: list[int]) -> None:
    """Collect the ids of the job's metric events until its ``end`` event."""
    with c.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        event = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("id: "):
                out.append(int(line[len("id: ") :]))
            elif line.startswith("data: ") and event == "end":
                return


def test_the_launcher_passes_the_checkpoint_flags(client: TestClient) -> None:
    argv = client.post("/v1/jobs:validate", json=job_spec()).json()["torchrun_argv"]
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--checkpoint-dir"] == "<job-dir>/checkpoints"
    assert flags["--checkpoint-every"] == "50" and flags["--keep-checkpoints"] == "3"
    assert flags["--resume"] == "auto" and "--init-from" not in flags
    body = job_spec(checkpoint_every=0, keep_checkpoints=0)
    argv = client.post("/v1/jobs:validate", json=body).json()["torchrun_argv"]
    assert argv[argv.index("--checkpoint-every") + 1] == "0"
    assert argv[argv.index("--keep-checkpoints") + 1] == "0"
    bad = client.post("/v1/jobs", json={**job_spec(), "max_restarts": -1})
    assert bad.status_code == 422 and "max_restarts" in bad.text
    # The fault settings: left out, the recipe's defaults (no flag); given, passed on.
    for flag in (
        "--on-checkpoint-error",
        "--collective-timeout",
        "--reduce-dtype",
        "--muon-variant",
        "--ns-dtype",
    ):
        assert flag not in flags
    body = job_spec(
        on_checkpoint_error="warn",
        collective_timeout=30,
        reduce_dtype="bfloat16",
        broadcast_dtype="bfloat16",
        muon_variant="normuon",
        ns_dtype="float32",
    )
    argv = client.post("/v1/jobs:validate", json=body).json()["torchrun_argv"]
    assert argv[argv.index("--on-checkpoint-error") + 1] == "warn"
    assert argv[argv.index("--collective-timeout") + 1] == "30"
    assert argv[argv.index("--reduce-dtype") + 1] == "bfloat16"
    assert argv[argv.index("--broadcast-dtype") + 1] == "bfloat16"
    assert argv[argv.index("--muon-variant") + 1] == "normuon"
    assert argv[argv.index("--ns-dtype") + 1] == "float32"
    for field, value in (
        ("reduce_dtype", "float16"),
        ("broadcast_dtype", "int8"),
        ("muon_variant", "adam"),
        ("ns_dtype", "float16"),
        ("on_checkpoint_error", "ignore"),
        ("collective_timeout", 0),
        ("collective_timeout", 86_401),
        ("collective_timeout", 2.5),
    ):
        bad = client.post("/v1/jobs", json=job_spec(**{field: value}))
        assert bad.status_code == 422, (field, value, bad.text)
        assert bad.json()["errors"][0]["field"] == f"body.train.{field}", bad.json()


def test_cancel_grace_flag_defaults_to_30_seconds() -> None:
    assert build_parser().parse_args([]).cancel_grace == 30.0
    assert build_parser().parse_args(["--cancel-grace-s", "5"]).cancel_grace == 5.0


def test_event_lines_are_not_points() -> None:
    raw = (
        b'{"step": 1, "loss": 2.0}\n'
        b'{"event": "stopped", "step": 1, "signal": "SIGTERM", "checkpoint": "x", "loss": null}\n'
    )
    chunk = parse_lines(raw, final=True)
    assert [step for step, _ in chunk.points] == [1]
    assert chunk.points[0][1] == {"step": 1, "loss": 2.0}
    assert chunk.summary is None and chunk.events[0]["event"] == "stopped"


def test_the_recipes_checkpoint_warnings_are_job_events(
    client: TestClient, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe's ``checkpoint_skipped`` and ``checkpoint_failed`` lines become warning
    events of the job: in its REST view (with messages naming the checkpoint and the cause,
    no server path) and in its event stream (``event: warning``), never as metric points."""
    monkeypatch.setenv("FAKE_EVENT_STEP", "2")
    job_id = client.post("/v1/jobs", json=job_spec(1, steps=4)).json()["id"]
    job = _wait_state(client, job_id, TERMINAL)
    assert job["state"] == "succeeded", job
    assert [p["step"] for p in _points(client, job_id)] == [1, 2, 3, 4]
    events = job["events"]
    assert [(e["kind"], e["level"], e["step"], e["attempt"]) for e in events] == [
        (contract.CHECKPOINT_SKIPPED_EVENT, "warning", 2, 1),
        (contract.CHECKPOINT_FAILED_EVENT, "warning", 2, 1),
    ]
    skipped, failed = (e["message"] for e in events)
    assert skipped == (
        "skipped the damaged checkpoint step_00000004: __0_0.distcp has 10 bytes, 20 were "
        "written; resumed from step 2"
    )
    # Attempt 1 resumed from nothing: the event's step does not make it a resume.
    assert job["attempts"][0]["resumed_from_step"] is None
    assert failed.startswith("the checkpoint of step 2 could not be written to <job-dir>/")
    assert "No space left on device" in failed and str(data_dir) not in json.dumps(job)
    # The stream sends both as warnings (before the end of a finished job).
    seen: list[tuple[str, dict[str, Any]]] = []
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        event = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: ") and event in ("warning", "end"):
                seen.append((event, json.loads(line[len("data: ") :])))
    assert [k for k, _ in seen] == ["warning", "warning", "end"]
    assert [d["message"] for _, d in seen[:2]] == [skipped, failed]
    assert all(d["kind"] in (contract.CHECKPOINT_SKIPPED_EVENT, contract.CHECKPOINT_FAILED_EVENT)
               for _, d in seen[:2])  # fmt: skip


def test_a_killed_rank_is_restarted_from_the_latest_checkpoint(
    tmp_path: Path, data_dir: Path, fake_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only rank kills itself with SIGKILL at step 8 of the first attempt (steps 6 and
    7 were reported after checkpoint 5): the job restarts once, resumes at step 6, and ends
    ``succeeded`` with two attempts, steps 1..20 once each (6 and 7 from the second
    attempt), the stream sending each step once, the weight of an uninterrupted run, and
    the attempts surviving a server restart."""
    monkeypatch.setenv("FAKE_CRASH_RANK", "0")
    monkeypatch.setenv("FAKE_CRASH_STEP", "8")
    monkeypatch.setenv("FAKE_CRASH_SIGNAL", "9")
    monkeypatch.setenv("FAKE_CRASH_ONCE", "1")
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.05")
    body = {**job_spec(1, steps=20, checkpoint_every=5, keep_checkpoints=2), "max_restarts": 1}
    app = create_app(make_settings(tmp_path, data_dir=data_dir))
    with TestClient(app) as c:
        job_id = c.post("/v1/jobs", json=body).json()["id"]
        streamed: list[int] = []
        reader = threading.Thread(target=_stream_steps, args=(c, job_id, streamed))
        reader.start()
        job = _wait_state(c, job_id, TERMINAL)
        reader.join(timeout=30)
        assert job["state"] == "succeeded", job
        first, second = job["attempts"]
        assert first["cause"] == "submitted" and first["resumed_from_step"] is None
        assert first["exit_code"] == -9 and "SIGKILL" in first["reason"]
        assert second["cause"] == "restart" and second["resumed_from_step"] == 5
        assert second["exit_code"] == 0 and second["finished_at"] is not None
        assert any("restart 1 of 1" in h["reason"] for h in job["history"])
        points = _points(c, job_id)
        assert [p["step"] for p in points] == list(range(1, 21))
        for p in points:  # re-run steps replaced their first attempt's points
            expected = "metrics.jsonl" if p["step"] <= 5 else "metrics.attempt-2.jsonl"
            assert p["metrics_file"] == expected, p
        assert streamed == sorted(set(streamed)) and set(streamed) == set(range(1, 21))
        assert _saved_weight(data_dir, job_id, 20) == pytest.approx(_weight(0, 20), abs=0)
        ckpts = c.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
        assert [k["step"] for k in ckpts] == [15, 20]  # keep_checkpoints=2
        folder = data_dir / "jobs" / job_id
        for k in ckpts:
            assert k["path"] == f"checkpoints/step_{k['step']:08d}"
            files = (folder / k["path"]).rglob("*")
            assert k["bytes"] == sum(f.stat().st_size for f in files if f.is_file())
    with TestClient(create_app(make_settings(tmp_path, data_dir=data_dir))) as c:
        assert _job(c, job_id)["attempts"] == job["attempts"]


@pytest.mark.parametrize(
    ("crash_env", "max_restarts", "attempts"),
    [
        ({"FAKE_CRASH_CODE": "1"}, 1, 2),  # an exception every time: retried, then failed
        ({"FAKE_CRASH_CODE": "3"}, 2, 1),  # divergence: never retried
        # A checkpoint that could not be written (the recipe's exit code 4): never retried.
        (
            {
                "FAKE_CRASH_CODE": str(contract.EXIT_CHECKPOINT_WRITE),
                "FAKE_CRASH_MESSAGE": "the checkpoint of step 3 could not be written to X "
                "(No space left on device): it needs about 1.0 MiB and 0.0 MiB are free",
            },
            2,
            1,
        ),
    ],
)
def test_restarts_are_bounded_and_skip_what_a_rerun_repeats(
    client: TestClient,
    monkeypatch: pytest.MonkeyPatch,
    crash_env: dict[str, str],
    max_restarts: int,
    attempts: int,
) -> None:
    monkeypatch.setenv("FAKE_CRASH_RANK", "0")
    monkeypatch.setenv("FAKE_CRASH_STEP", "3")
    for k, v in crash_env.items():
        monkeypatch.setenv(k, v)
    body = {**job_spec(1, steps=10, checkpoint_every=2), "max_restarts": max_restarts}
    job = _wait_state(client, client.post("/v1/jobs", json=body).json()["id"], TERMINAL)
    assert job["state"] == "failed", job
    assert len(job["attempts"]) == attempts
    code = int(crash_env["FAKE_CRASH_CODE"])
    assert all(a["exit_code"] == code and a["finished_at"] for a in job["attempts"])
    assert job["exit_code"] == code and job["failure"]["rank"] == 0
    if attempts > 1:  # the restart resumed from checkpoint 2 and met the same crash
        assert job["attempts"][1]["resumed_from_step"] == 2
    if code == contract.EXIT_CHECKPOINT_WRITE:
        assert "could not write a checkpoint" in job["reason"], job["reason"]
        assert "the disk is full" in job["reason"] and "No space left" in job["reason"]
        assert "not retried" in job["reason"]


def test_cancel_saves_a_checkpoint_and_resume_continues_it(
    client: TestClient, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.1")
    body = job_spec(2, steps=500, checkpoint_every=0)
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    wait_until(lambda: (_job(client, job_id)["summary"]["last_step"] or 0) >= 3, 60, "step 3")
    running = client.post(f"/v1/jobs/{job_id}/resume")
    assert running.status_code == 409 and "cancel it first" in running.json()["detail"]
    client.post(f"/v1/jobs/{job_id}/cancel")
    job = _wait_state(client, job_id, TERMINAL)
    assert job["state"] == "cancelled"
    # SIGTERM reached the ranks once: the recipe finished its step, saved and exited 0
    # (torchrun, had it been signalled too, would have sent a second SIGTERM).
    assert job["attempts"][0]["exit_code"] == 0
    ckpts = client.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    assert len(ckpts) == 1
    k = ckpts[0]["step"]
    assert [p["step"] for p in _points(client, job_id)] == list(range(1, k + 1))
    too_few = client.post(f"/v1/jobs/{job_id}/resume", json={"steps": k})
    assert too_few.status_code == 409 and f"more than {k}" in too_few.json()["detail"]
    r = client.post(f"/v1/jobs/{job_id}/resume", json={"steps": k + 4})
    assert r.status_code == 202, r.text
    assert r.json()["state"] == "queued" and r.json()["train"]["steps"] == k + 4
    job = _wait_state(client, job_id, {"succeeded", "failed"})
    assert job["state"] == "succeeded", job
    assert job["cancel_requested"] is False and job["summary"]["last_step"] == k + 4
    resumed = job["attempts"][1]
    assert resumed["cause"] == "resume" and resumed["resumed_from_step"] == k
    assert [p["step"] for p in _points(client, job_id)] == list(range(1, k + 5))
    assert _saved_weight(data_dir, job_id, k + 4) == pytest.approx(_weight(0, k + 4), abs=0)
    done = client.post(f"/v1/jobs/{job_id}/resume")
    assert done.status_code == 409 and "pass a larger steps" in done.json()["detail"]


def test_resume_without_a_checkpoint_is_409(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CRASH_RANK", "0")
    monkeypatch.setenv("FAKE_CRASH_STEP", "2")
    job_id = client.post("/v1/jobs", json=job_spec(1, steps=5, checkpoint_every=5)).json()["id"]
    assert _wait_state(client, job_id, TERMINAL)["state"] == "failed"
    r = client.post(f"/v1/jobs/{job_id}/resume")
    assert r.status_code == 409 and "saved no checkpoint" in r.json()["detail"]
    assert client.get(f"/v1/jobs/{job_id}/checkpoints").json() == {"items": []}


def test_init_from_takes_another_jobs_weights(client: TestClient, data_dir: Path) -> None:
    source = client.post("/v1/jobs", json=job_spec(1, steps=10, checkpoint_every=5)).json()
    assert _wait_state(client, source["id"], TERMINAL)["state"] == "succeeded"
    unknown = client.post("/v1/jobs", json={**job_spec(1), "init_from": {"job": "nope", "step": 5}})
    assert unknown.status_code == 422
    assert unknown.json()["errors"][0]["field"] == "body.init_from.job"
    missing = {**job_spec(1), "init_from": {"job": source["id"], "step": 7}}
    r = client.post("/v1/jobs", json=missing)
    assert r.status_code == 422 and "step(s) 5, 10" in r.text
    assert r.json()["errors"][0]["field"] == "body.init_from.step"
    body = {**job_spec(1, steps=3, seed=1), "init_from": {"job": source["id"], "step": 5}}
    plan = client.post("/v1/jobs:validate", json=body).json()["torchrun_argv"]
    assert plan[plan.index("--init-from") + 1] == "<job-dir>/init/step_00000005"
    job = client.post("/v1/jobs", json=body).json()
    assert job["init_from"] == {"job": source["id"], "step": 5}
    # The source's checkpoint may go away: the job has its own (hard-linked) copy.
    assert client.delete(f"/v1/jobs/{source['id']}").status_code == 204
    done = _wait_state(client, job["id"], TERMINAL)
    assert done["state"] == "succeeded", done
    w = _weight(0, 5)  # step 1 starts from the source's weight at step 5, not the seed
    for step in range(1, 4):
        w = w * 0.9 + step * 0.01
    assert _saved_weight(data_dir, job["id"], 3) == pytest.approx(w, abs=0)


def test_resume_passes_over_checkpoints_the_recipe_would_not_load(
    client: TestClient, data_dir: Path
) -> None:
    """The server's latest checkpoint is the recipe's (`dmuon_recipe_contract`): a folder
    whose manifest is gone is incomplete, one whose file changed size is damaged; resume
    starts from the newest whole one, where the recipe itself resumes."""
    import dmuon_recipe_contract as contract

    body = job_spec(1, steps=6, checkpoint_every=2, keep_checkpoints=3)
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    assert _wait_state(client, job_id, TERMINAL)["state"] == "succeeded"
    folder = data_dir / "jobs" / job_id / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_00000002", "step_00000004", "step_00000006",
    ]  # fmt: skip
    (folder / "step_00000006" / "state.json").write_text("{}")  # another size: damaged
    (folder / "step_00000004" / contract.MANIFEST_FILE).unlink()  # the save never finished
    r = client.post(f"/v1/jobs/{job_id}/resume", json={"steps": 8})
    assert r.status_code == 202, r.text
    job = _wait_state(client, job_id, {"succeeded", "failed"})
    assert job["state"] == "succeeded", job
    assert job["attempts"][1]["resumed_from_step"] == 2
    assert [p["step"] for p in _points(client, job_id)] == list(range(1, 9))
    assert _saved_weight(data_dir, job_id, 8) == pytest.approx(_weight(0, 8), abs=0)
