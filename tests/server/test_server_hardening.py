"""What a hostile client or a careless operator tries, against the in-process app:
secrets in job environments, admission control, body limits, server paths in responses,
the ``running`` state, one time format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient
from server_helpers import (
    TERMINAL,
    finished_job,
    iter_sse,
    job_spec,
    make_settings,
    processes_of_job,
    wait_until,
)

from dmuon_server.app import create_app
from dmuon_server.recipe.admission import RECIPE_MODELS

PROBLEM = "application/problem+json"


def _job(c: TestClient, job_id: str) -> dict:
    return c.get(f"/v1/jobs/{job_id}").json()


def test_jobs_never_see_the_token_or_marked_secrets(
    tmp_path: Path, data_dir: Path, fake_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMUON_SERVER_TOKEN", "tok-in-env")
    monkeypatch.setenv("CLOUD_KEY", "hunter2")
    monkeypatch.setenv("HARMLESS", "kept")
    monkeypatch.setenv("UNLISTED", "the operator's")
    settings = make_settings(
        tmp_path,
        data_dir=data_dir,
        token="tok-in-env",
        secret_env=("CLOUD_KEY",),
        job_env=("FAKE_*", "HARMLESS"),
    )
    with TestClient(create_app(settings)) as c:
        auth = {"Authorization": "Bearer tok-in-env"}
        job = c.post("/v1/jobs", json=job_spec(steps=100_000), headers=auth).json()
        wait_until(lambda: _job_state(c, job["id"], auth) == "running", 60, "the job to run")
        procs = processes_of_job(job["id"])
        assert len(procs) >= 3  # the runner (torchrun) and two ranks
        envs = [p.environ() for p in procs]
        assert all(e.get("HARMLESS") == "kept" for e in envs)  # --job-env lists it
        for env in envs:
            assert "DMUON_SERVER_TOKEN" not in env and "CLOUD_KEY" not in env
            assert "UNLISTED" not in env  # not on the allow-list
            assert "tok-in-env" not in env.values() and "hunter2" not in env.values()
        c.post(f"/v1/jobs/{job['id']}/cancel", headers=auth)
        wait_until(lambda: _job_state(c, job["id"], auth) == "cancelled", 60, "the job to end")


def _job_state(c: TestClient, job_id: str, headers: dict) -> str:
    return c.get(f"/v1/jobs/{job_id}", headers=headers).json()["state"]


def _expected_per_rank(model: str, b: int, t: int, accum: int, n: int, corpus: int) -> int:
    """The documented formula, written out again from the preset's sizes."""
    m = RECIPE_MODELS[model]
    params = (
        2 * m.vocab_size * m.dim
        + m.n_layers * (4 * m.dim**2 + 3 * m.dim * m.ffn_dim + 2 * m.dim)
        + m.dim
    )
    act = 4 * b * t * (m.n_layers * (12 * m.dim + 4 * m.ffn_dim) + 2 * m.dim + 3 * 256)
    batch = 8 * (t + 1) * (accum * b + math.ceil(64 / n))
    return 16 * params + act + batch + 3 * min(corpus, 4 << 20) + (512 << 20)


def test_validate_reports_the_estimates(client: TestClient, tmp_path: Path) -> None:
    root = tmp_path / "datasets"
    root.mkdir()
    text = "the quick brown fox\n" * 500  # 10,000 bytes
    (root / "one.txt").write_text(text)
    body = job_spec(nproc=2, micro_batch_size=3, accum_steps=2, seq_len=64, data="one.txt")
    plan = client.post("/v1/jobs:validate", json=body).json()
    adm = plan["admission"]
    assert adm["max_seq_len"] == 1024 and adm["tokens_per_step"] == 3 * 2 * 2 * 64
    data = adm["data"]
    assert data["source"] == "<data-root>/one.txt" and data["files"] == 1
    assert data["bytes"] == 10_000
    # One file is split by bytes: the last 5 % is validation (the recipe's rule).
    assert (data["train_tokens"], data["val_tokens"]) == (9_500, 500)
    mem = adm["memory"]
    assert mem["per_rank_bytes"] == _expected_per_rank("tiny", 3, 64, 2, 2, 10_000)
    assert mem["job_bytes"] == 2 * mem["per_rank_bytes"]
    assert mem["host_total_bytes"] == psutil.virtual_memory().total
    assert mem["limit_bytes"] == psutil.virtual_memory().total // 2  # the default


@pytest.mark.parametrize(
    ("train", "fields"),
    [
        # The specs that used to be accepted: far past the model and the host.
        (
            {"seq_len": 65_536, "micro_batch_size": 4096, "accum_steps": 1024},
            {"body.train.seq_len", "body.train.micro_batch_size"},
        ),
        ({"seq_len": 65_536}, {"body.train.seq_len"}),
        ({"seq_len": 1025}, {"body.train.seq_len"}),
        ({"micro_batch_size": 4096, "seq_len": 1024}, {"body.train.micro_batch_size"}),
    ],
)
def test_specs_the_recipe_cannot_run_are_refused(
    client: TestClient, train: dict, fields: set[str]
) -> None:
    for path in ("/v1/jobs:validate", "/v1/jobs"):
        r = client.post(path, json=job_spec(**train))
        assert r.status_code == 422, r.text
        body = r.json()
        assert {e["field"] for e in body["errors"]} == fields
        assert body["admission"]["memory"]["job_bytes"] > 0  # the figures come along
    assert client.get("/v1/jobs").json()["items"] == []


def test_the_memory_limit_is_the_operators(tmp_path: Path, data_dir: Path, fake_env: None) -> None:
    per_rank = _expected_per_rank("small", 4, 128, 1, 1, 0)
    settings = make_settings(tmp_path, data_dir=data_dir, max_job_memory=per_rank * 3)
    with TestClient(create_app(settings)) as c:
        spec = {"model": "small", "micro_batch_size": 4, "seq_len": 128, "accum_steps": 1}
        fits = c.post("/v1/jobs:validate", json=job_spec(nproc=1, **spec)).json()
        assert fits["admission"]["memory"]["per_rank_bytes"] > per_rank  # plus the corpus
        r = c.post("/v1/jobs:validate", json=job_spec(nproc=4, **spec))
        assert r.status_code == 422
        assert "--max-job-memory" in r.json()["detail"]


def test_data_the_recipe_would_reject_is_refused_at_once(
    client: TestClient, tmp_path: Path
) -> None:
    root = tmp_path / "datasets"
    (root / "empty").mkdir(parents=True)
    (root / "empty" / ".hidden").write_text("x" * 10_000)  # the recipe skips hidden files
    (root / "tiny.txt").write_text("hello")
    (root / "short.txt").write_text("y" * 1000)
    cases = {
        "empty": "holds no non-empty file to read",
        "tiny.txt": "fewer than seq_len + 1",
    }
    for data, why in cases.items():
        r = client.post("/v1/jobs", json=job_spec(data=data, seq_len=32))
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["field"] == "body.train.data"
        assert why in r.json()["detail"]
    # 1000 bytes: 950 train, 50 validation tokens; seq_len 64 needs 65 in each.
    r = client.post("/v1/jobs", json=job_spec(data="short.txt", seq_len=64))
    assert r.status_code == 422 and "validation split" in r.json()["detail"]
    assert client.post("/v1/jobs:validate", json=job_spec(data="short.txt", seq_len=32)).is_success


def test_bodies_over_the_limit_are_413(tmp_path: Path, data_dir: Path, fake_env: None) -> None:
    settings = make_settings(tmp_path, data_dir=data_dir, max_body_bytes=4096)
    with TestClient(create_app(settings)) as c:
        big = job_spec(name="x" * 100)
        big["train"]["padding"] = "y" * 10_000
        r = c.post("/v1/jobs", json=big)
        assert r.status_code == 413 and r.headers["content-type"].startswith(PROBLEM)
        assert "4096 bytes" in r.json()["detail"]

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"nproc_per_node": 1, "train": {"pad": "'
            for _ in range(10):
                yield b"z" * 1000
            yield b'"}}'

        r = c.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert c.post("/v1/jobs:validate", json=job_spec()).status_code == 200
        assert c.get("/v1/jobs").json()["items"] == []


def test_no_server_paths_reach_clients(client: TestClient, data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "a.txt").write_text("some text\n" * 200)
    plan = client.post("/v1/jobs:validate", json=job_spec(data="a.txt")).json()
    text = json.dumps(plan)
    assert str(tmp_path) not in text and str(data_dir) not in text
    assert plan["argv"][0] == "python" and "<job-dir>/metrics.jsonl" in plan["argv"]
    assert plan["env"]["DMUON_SERVER_DATA_DIR"] == "<data-dir>"
    job = client.post("/v1/jobs", json=job_spec(steps=3)).json()
    finished_job(client, job["id"])
    logs = client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 1000}).json()["lines"]
    assert any("<job-dir>/metrics.jsonl" in line for line in logs)  # fake_train prints it
    assert not any(str(data_dir) in line for line in logs)


def test_data_roots_are_explicit(tmp_path: Path, data_dir: Path, fake_env: None) -> None:
    """Without --data-root no path is accepted: not the server's folder, not its database."""
    settings = make_settings(tmp_path, data_dir=data_dir, data_roots=())
    with TestClient(create_app(settings)) as c:
        for data in (str(data_dir / "dmuon-server.sqlite3"), str(Path.cwd()), "x"):
            r = c.post("/v1/jobs:validate", json=job_spec(data=data))
            assert r.status_code == 422
            assert "--data-root" in r.json()["detail"] and str(data_dir) not in r.text
        assert c.post("/v1/jobs:validate", json=job_spec()).status_code == 200


def test_running_means_a_point_arrived_and_times_agree(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_STEP_SECONDS", "1.0")  # the metrics file exists long before
    job = client.post("/v1/jobs", json=job_spec(steps=2)).json()
    seen = []
    while (j := _job(client, job["id"]))["state"] not in TERMINAL:
        seen.append((j["state"], j["summary"]["points"]))
    assert ("starting", 0) in seen
    assert all(points >= 1 for state, points in seen if state == "running"), seen
    done = _job(client, job["id"])
    assert done["state"] == "succeeded"
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
        states = [e.json() for e in iter_sse(r) if e.event == "state"]
    rest = done["history"][-1]
    assert states[-1]["at"] == rest["at"] and rest["at"].endswith("Z")
