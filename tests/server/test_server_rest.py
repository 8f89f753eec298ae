"""REST API against the in-process app (httpx via TestClient): specs, errors, auth, paging.

Jobs here run no process (`fake_launcher`), except where a test says it needs a real one."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import finished_job, job_spec, make_settings, wait_until

from dmuon_server.app import create_app

PROBLEM = "application/problem+json"


@pytest.fixture
def client(fake_client: TestClient) -> TestClient:
    """This module's routes need jobs, not real runs."""
    return fake_client


def _problem(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith(PROBLEM)
    body = r.json()
    assert body["status"] == status and body["title"] and "type" in body
    return body


def _fields(body: dict) -> set[str]:
    return {e["field"] for e in body["errors"]}


def test_healthz_and_openapi(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    schema = client.get("/openapi.json").json()
    for path in (
        "/v1/jobs",
        "/v1/jobs:validate",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/metrics",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/logs",
        "/metrics",
    ):
        assert path in schema["paths"], path
    err = schema["paths"]["/v1/jobs"]["post"]["responses"]["422"]["content"]
    assert PROBLEM in err
    # The machine limit is part of the published schema.
    assert (
        schema["components"]["schemas"]["JobCreate"]["properties"]["nproc_per_node"]["maximum"] == 4
    )


def test_validate_is_a_dry_run_with_exact_argv(client: TestClient) -> None:
    body = job_spec(nproc=2, steps=7, micro_batch_size=3, accum_steps=4, seq_len=16)
    body["train"].update(warmup_steps=9, eval_every=50)
    r = client.post("/v1/jobs:validate", json=body)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["world_size"] == 2
    assert plan["global_batch_sequences"] == 3 * 4 * 2
    assert plan["global_batch_tokens"] == 3 * 4 * 2 * 16
    assert plan["total_tokens"] == 3 * 4 * 2 * 16 * 7
    tr = plan["torchrun_argv"]
    assert tr[1:3] == ["-m", "torch.distributed.run"]
    assert tr[3:6] == ["--standalone", "--nproc_per_node", "2"]
    assert "29500" not in " ".join(tr)
    i = tr.index("fake_train")
    recipe = tr[i + 1 :]
    assert recipe[:2] == ["--model", "tiny"]
    for flag, value in [
        ("--steps", "7"),
        ("--micro-batch-size", "3"),
        ("--accum-steps", "4"),
        ("--seq-len", "16"),
        ("--lr", "0.02"),
        ("--adamw-lr", "0.003"),
        ("--optimizer", "dmuon"),
        ("--mode", "z2"),
        ("--seed", "0"),
        ("--warmup-steps", "9"),
        ("--eval-every", "50"),
    ]:
        assert recipe[recipe.index(flag) + 1] == value, flag
    assert "--metrics-file" in recipe
    # The argv the server spawns wraps the same torchrun arguments.
    assert plan["argv"][1:3] == ["-m", "dmuon_server.runner"]
    assert plan["argv"][plan["argv"].index("--") + 1 :] == tr[3:]
    assert plan["env"]["PYTHONUNBUFFERED"] == "1"
    assert int(plan["env"]["OMP_NUM_THREADS"]) >= 1
    assert any("warmup" in w for w in plan["warnings"])
    assert any("eval_every" in w for w in plan["warnings"])
    assert client.get("/v1/jobs").json()["items"] == []


def test_create_get_list_and_location(real_client: TestClient) -> None:
    r = real_client.post("/v1/jobs", json=job_spec(name="first", steps=5))
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] in {"queued", "starting"}
    assert job["name"] == "first" and job["train"]["steps"] == 5 and job["created_at"]
    got = real_client.get(r.headers["location"]).json()
    assert got["id"] == job["id"]
    assert got["history"][0]["state"] == "queued" and got["history"][0]["reason"]
    done = finished_job(real_client, job["id"])
    assert done["state"] == "succeeded", done
    assert done["exit_code"] == 0
    assert [h["state"] for h in done["history"]] == ["queued", "starting", "running", "succeeded"]
    s = done["summary"]
    assert s["last_step"] == 5 and s["points"] == 5 and s["progress"] == 1.0
    assert isinstance(s["last_loss"], float) and s["eta_s"] == 0.0
    assert done["recipe_summary"] == {"steps": 5, "final_loss": pytest.approx(s["last_loss"])}


def test_pagination_and_state_filter(client: TestClient) -> None:
    ids = []
    for i in range(5):
        body = job_spec(name=f"j{i}", steps=1_000)
        ids.append(client.post("/v1/jobs", json=body).json()["id"])
    for job_id in ids[1:]:
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    client.post(f"/v1/jobs/{ids[0]}/cancel")
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/jobs", params=params).json()
        seen += [j["id"] for j in page["items"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == ids[::-1] and pages == 3
    finished_job(client, ids[0])
    cancelled = client.get("/v1/jobs", params={"state": "cancelled"}).json()["items"]
    assert {j["id"] for j in cancelled} == set(ids)
    assert client.get("/v1/jobs", params={"state": ["running", "queued"]}).json()["items"] == []
    _problem(client.get("/v1/jobs", params={"cursor": "bm9wZQ"}), 422)
    _problem(client.get("/v1/jobs", params={"state": "bogus"}), 422)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["train"].update(unknown_flag=1), "body.train.unknown_flag"),
        (lambda b: b.update(nice=3), "body.nice"),
        (lambda b: b.update(priority=1001), "body.priority"),
        (lambda b: b.update(priority="high"), "body.priority"),
        (lambda b: b["train"].update(steps=0), "body.train.steps"),
        (lambda b: b["train"].update(steps="10"), "body.train.steps"),
        (lambda b: b["train"].update(accum_steps=-1), "body.train.accum_steps"),
        (lambda b: b["train"].update(lr=0), "body.train.lr"),
        (lambda b: b["train"].update(adamw_lr=1e9), "body.train.adamw_lr"),
        (lambda b: b["train"].update(optimizer="sgd"), "body.train.optimizer"),
        (lambda b: b["train"].update(mode="z1"), "body.train.mode"),
        # Not a preset: a path, as --model takes it, which this server has no root for.
        (lambda b: b["train"].update(model="huge"), "body.train.model.path"),
        (lambda b: b["train"].update(model=3), "body.train.model"),
        (lambda b: b["train"].pop("model"), "body.train.model"),  # the one field it needs
        (lambda b: b.update(nproc_per_node=0), "body.nproc_per_node"),
        (lambda b: b.update(nproc_per_node=5), "body.nproc_per_node"),  # above the limit (4)
        (lambda b: b.update(nproc_per_node=True), "body.nproc_per_node"),
        (lambda b: b.update(name=""), "body.name"),
    ],
)
def test_bad_specs_are_422_naming_the_field(client: TestClient, mutate, field: str) -> None:
    body = job_spec()
    mutate(body)
    for path in ("/v1/jobs", "/v1/jobs:validate"):
        problem = _problem(client.post(path, json=body), 422)
        assert field in _fields(problem), problem
        assert field in problem["title"] and problem["detail"]
    assert client.get("/v1/jobs").json()["items"] == []


def test_malformed_json_is_400_missing_or_wrong_bodies_422(client: TestClient) -> None:
    bad = client.post(
        "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert _problem(bad, 400)["title"] == "Malformed request body"
    _problem(client.post("/v1/jobs"), 422)
    _problem(client.post("/v1/jobs", json=[1, 2]), 422)
    # A method a path does not have: 405 with its own title and the Allow header.
    r = client.put("/v1/jobs")
    assert _problem(r, 405)["title"] == "Method not allowed"
    assert set(r.headers["allow"].split(", ")) == {"GET", "POST"}


def test_data_paths_must_resolve_inside_the_roots(client: TestClient, tmp_path: Path) -> None:
    root = tmp_path / "datasets"
    (root / "corpus").mkdir(parents=True)
    for name in "abc":
        (root / "corpus" / f"{name}.txt").write_text("hello world\n" * 100)
    outside = tmp_path / "secret.txt"
    outside.write_text("no")
    (root / "escape").symlink_to(outside)
    for given in (str(root / "corpus"), "corpus"):  # absolute, or relative to the root
        ok = client.post("/v1/jobs:validate", json=job_spec(data=given))
        assert ok.status_code == 200, ok.text
        argv = ok.json()["torchrun_argv"]
        assert argv[argv.index("--data") + 1] == "<data-root>/corpus"
    for bad in (
        str(outside),
        str(root / ".." / "secret.txt"),
        str(root / "escape"),  # a symlink out of the root
        str(root / "missing.txt"),
        "/etc/passwd",
        "0" * 4000,  # a name longer than the file system allows
    ):
        problem = _problem(client.post("/v1/jobs", json=job_spec(data=bad)), 422)
        assert _fields(problem) == {"body.train.data"}, problem


def test_unknown_job_ids_are_404(client: TestClient) -> None:
    for method, path in [
        ("GET", "/v1/jobs/nope"),
        ("POST", "/v1/jobs/nope/cancel"),
        ("DELETE", "/v1/jobs/nope"),
        ("GET", "/v1/jobs/nope/metrics"),
        ("GET", "/v1/jobs/nope/events"),
        ("GET", "/v1/jobs/nope/logs"),
    ]:
        body = _problem(client.request(method, path), 404)
        assert "nope" in body["detail"]
    _problem(client.get("/v1/jobs/" + "x" * 65), 422)


def test_delete_only_finished_jobs(real_client: TestClient, data_dir: Path) -> None:
    job = real_client.post("/v1/jobs", json=job_spec(steps=10_000)).json()
    wait_until(
        lambda: real_client.get(f"/v1/jobs/{job['id']}").json()["state"] == "running", 60, "running"
    )
    _problem(real_client.delete(f"/v1/jobs/{job['id']}"), 409)
    assert real_client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    assert finished_job(real_client, job["id"])["state"] == "cancelled"
    # Cancelling again is fine (idempotent), cancelling a deleted job is not.
    assert real_client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    assert (data_dir / "jobs" / job["id"]).is_dir()
    assert real_client.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert not (data_dir / "jobs" / job["id"]).exists()
    _problem(real_client.get(f"/v1/jobs/{job['id']}"), 404)
    _problem(real_client.get(f"/v1/jobs/{job['id']}/metrics"), 404)


def test_cancel_of_a_succeeded_job_is_409(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=job_spec(steps=2)).json()
    assert finished_job(client, job["id"])["state"] == "succeeded"
    _problem(client.post(f"/v1/jobs/{job['id']}/cancel"), 409)


def test_idempotency_key_same_spec_200_other_spec_409(client: TestClient) -> None:
    headers = {"Idempotency-Key": "abc-123"}
    first = client.post("/v1/jobs", json=job_spec(steps=3), headers=headers)
    assert first.status_code == 201
    again = client.post("/v1/jobs", json=job_spec(steps=3), headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == first.headers["location"]
    other = _problem(client.post("/v1/jobs", json=job_spec(steps=4), headers=headers), 409)
    assert other["job_id"] == first.json()["id"]
    assert client.post("/v1/jobs", json=job_spec(steps=3)).status_code == 201  # no key: new job
    _problem(client.post("/v1/jobs", json=job_spec(), headers={"Idempotency-Key": "a b"}), 422)


def test_idempotency_key_survives_an_upgrade_that_adds_spec_fields(
    tmp_path: Path, data_dir: Path, fake_env: None
) -> None:
    """A job an older server stored (its spec without the fields added since, hashed
    whole) is found again by its key when the same body is posted to this server."""
    import hashlib

    from dmuon_server.schemas import JobCreate
    from dmuon_server.storage.store import Store

    body = job_spec(steps=3)
    settings = make_settings(tmp_path, data_dir=data_dir)
    older = JobCreate.model_validate(body).model_dump(mode="json")
    for added in ("max_restarts", "init_from", "nnodes", "partition", "time_limit", "account"):
        del older[added]
    stored = json.dumps(older, sort_keys=True, separators=(",", ":"))
    store = Store(settings.db_path)
    store.create_job(
        job_id="older",
        name=None,
        nproc=2,
        spec=stored,
        spec_hash=hashlib.sha256(stored.encode()).hexdigest(),
        idempotency_key="k-older",
        argv=[],
    )
    store.transition("older", "cancelled", "cancelled while queued")
    store.close()
    with TestClient(create_app(settings)) as c:
        again = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k-older"})
        assert again.status_code == 200 and again.json()["id"] == "older", again.text
        explicit = dict(body, max_restarts=0)  # a default written out is the same spec
        same = c.post("/v1/jobs", json=explicit, headers={"Idempotency-Key": "k-older"})
        assert same.status_code == 200 and same.json()["id"] == "older", same.text
        other = c.post("/v1/jobs", json=job_spec(steps=4), headers={"Idempotency-Key": "k-older"})
        assert _problem(other, 409)["job_id"] == "older"
        assert [j["id"] for j in c.get("/v1/jobs").json()["items"]] == ["older"]


def test_concurrent_submissions_with_one_key_create_one_job(
    tmp_path: Path, data_dir: Path, fake_env: None
) -> None:
    app = create_app(make_settings(tmp_path, data_dir=data_dir))
    body = job_spec(steps=2)
    with TestClient(app) as c:

        def submit(_: int) -> tuple[int, str]:
            r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": "same-key"})
            return r.status_code, r.json()["id"]

        with ThreadPoolExecutor(max_workers=20) as pool:
            results = list(pool.map(submit, range(20)))
        codes = sorted(code for code, _ in results)
        assert codes == [200] * 19 + [201] or codes == [201] + [200] * 19
        assert codes.count(201) == 1
        assert len({job_id for _, job_id in results}) == 1
        assert len(c.get("/v1/jobs").json()["items"]) == 1
        finished_job(c, results[0][1])


def test_token_auth(tmp_path: Path, data_dir: Path, fake_env: None) -> None:
    app = create_app(make_settings(tmp_path, data_dir=data_dir, token="s3cret-token"))
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Basic s3cret-token"},
            {"Authorization": "Bearer s3cret-token-and-more"},
        ):
            for method, path in [
                ("GET", "/v1/jobs"),
                ("POST", "/v1/jobs"),
                ("GET", "/metrics"),
                ("GET", "/openapi.json"),
                ("GET", "/v1/jobs/x/events"),
            ]:
                r = c.request(method, path, headers=headers, json=job_spec())
                body = _problem(r, 401)
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert "token" in body["detail"]
        good = {"Authorization": "Bearer s3cret-token"}
        assert c.get("/v1/jobs", headers=good).status_code == 200
        assert c.get("/metrics", headers=good).status_code == 200
        schema = c.get("/openapi.json", headers=good).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_prometheus_metrics(client: TestClient) -> None:
    client.post("/v1/jobs", json=job_spec(steps=10_000))
    client.post("/v1/jobs", json=job_spec(steps=10_000))
    wait_until(lambda: "dmuon_queue_depth 1" in client.get("/metrics").text, 30, "queue depth 1")
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert "# TYPE dmuon_jobs gauge" in text
    assert 'dmuon_jobs{state="queued"} 1' in text
    assert "dmuon_active_streams 0" in text
    for job in client.get("/v1/jobs").json()["items"]:
        client.post(f"/v1/jobs/{job['id']}/cancel")
    for job in client.get("/v1/jobs").json()["items"]:
        finished_job(client, job["id"])
    assert 'dmuon_jobs{state="cancelled"} 2' in client.get("/metrics").text


def test_logs_tail_is_bounded(real_client: TestClient) -> None:
    job = real_client.post("/v1/jobs", json=job_spec(steps=40)).json()
    finished_job(real_client, job["id"])
    logs = real_client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 3}).json()
    assert len(logs["lines"]) == 3 and logs["truncated"] is True
    full = real_client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 10_000}).json()["lines"]
    assert any("step 40 loss" in line for line in full)
    assert any("[default1]" in line for line in full)  # every rank's output is there
    _problem(real_client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 0}), 422)
    _problem(real_client.get(f"/v1/jobs/{job['id']}/logs", params={"tail": 10_001}), 422)


def test_metrics_pages_have_every_point(real_client: TestClient, data_dir: Path) -> None:
    job = real_client.post("/v1/jobs", json=job_spec(steps=25, eval_every=10)).json()
    finished_job(real_client, job["id"])
    items, after = [], -1
    while True:
        page = real_client.get(
            f"/v1/jobs/{job['id']}/metrics", params={"after_step": after, "limit": 7}
        ).json()
        items += page["items"]
        if page["next"] is None:
            break
        after = page["next"]
    with (data_dir / "jobs" / job["id"] / "metrics.jsonl").open() as f:
        lines = [json.loads(x) for x in f if x.strip()]
    points = [x for x in lines if "step" in x]
    assert items == points  # the same objects, unknown keys included, in order
    assert [p["step"] for p in items] == list(range(26))
    assert items[10]["val_loss"] == pytest.approx(items[10]["loss"] + 0.05)
    _problem(real_client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 0}), 422)
    _problem(real_client.get(f"/v1/jobs/{job['id']}/metrics", params={"after_step": -2}), 422)


def test_server_never_imports_torch_or_dmuon() -> None:
    code = (
        "import sys, dmuon_server.app, dmuon_server.cli, dmuon_server.scheduling.supervisor;"
        "bad = [m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'dmuon'];"
        "assert not bad, bad"
    )
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ}, timeout=60)


def test_a_spec_of_only_the_model_runs_on_the_recipes_defaults(client: TestClient) -> None:
    import dmuon_recipe_contract as contract

    r = client.post("/v1/jobs:validate", json={"nproc_per_node": 1, "train": {"model": "tiny"}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/jobs", json={"nproc_per_node": 1, "train": {"model": "tiny"}})
    assert r.status_code == 201, r.text
    train = r.json()["train"]
    for name in ("steps", "micro_batch_size", "accum_steps", "seq_len", "lr", "optimizer"):
        assert train[name] == contract.flag(name).default, name
    client.post(f"/v1/jobs/{r.json()['id']}/cancel")


def test_a_minimal_spec_runs_one_process_or_one_per_gpu_asked_for(client: TestClient) -> None:
    """``{"train": {"model": "tiny"}}`` is a whole spec: one process; with
    ``gpus_per_node`` and no ``nproc_per_node``, one process per GPU (the spec echoed
    back, with the recipe's defaults filled in, is the oracle)."""
    r = client.post("/v1/jobs", json={"train": {"model": "tiny"}})
    assert r.status_code == 201, r.text
    assert r.json()["nproc_per_node"] == 1
    from dmuon_server.schemas import JobCreate

    spec = {"train": {"model": "tiny"}}
    assert JobCreate.model_validate({**spec, "gpus_per_node": 4}).nproc_per_node == 4
    assert JobCreate.model_validate({**spec, "gpus_per_node": 0}).nproc_per_node == 1
    given = {**spec, "gpus_per_node": 4, "nproc_per_node": 2}
    assert JobCreate.model_validate(given).nproc_per_node == 2


def test_a_recipe_config_file_is_a_train_spec(client: TestClient) -> None:
    """The recipe's ``--config`` TOML (option spellings, a table) parsed as a job's
    ``train``: the same job as the flat field names give (the echoed spec is the
    oracle); a key the file gives twice is refused."""
    import tomllib

    text = """
model = "tiny"
micro-batch-size = 2
seq_len = 32

[schedule]
steps = 3
lr-schedule = "wsd"
warmup_steps = 1
"""
    flat = {
        "model": "tiny",
        "micro_batch_size": 2,
        "seq_len": 32,
        "steps": 3,
        "lr_schedule": "wsd",
        "warmup_steps": 1,
    }
    from_file = client.post("/v1/jobs", json={"train": tomllib.loads(text)})
    from_fields = client.post("/v1/jobs", json={"train": flat})
    assert from_file.status_code == from_fields.status_code == 201, from_file.text
    assert from_file.json()["train"] == from_fields.json()["train"]
    twice = {"train": {"steps": 3, "schedule": {"steps": 4}, "model": "tiny"}}
    r = client.post("/v1/jobs:validate", json=twice)
    assert r.status_code == 422 and "steps is given twice" in r.text
