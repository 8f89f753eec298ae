"""A security reviewer's and an operator's probe of a live ``dmuon-server`` process, each
point through a real HTTP client (httpx): symbolic links out of the data roots, DNS
rebinding, poisoned metrics lines, late cancels, and the smaller holes."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import (
    TERMINAL,
    LiveServer,
    fake_recipe_env,
    job_spec,
    processes_of_job,
    wait_until,
)

Start = Callable[..., LiveServer]


@pytest.fixture
def start_server(data_dir: Path) -> Iterator[Start]:
    """Start live servers on ``data_dir`` (fake recipe, extra flags and knobs); all are
    stopped at the end."""
    started: list[LiveServer] = []

    def start(*flags: str, **knobs: str) -> LiveServer:
        server = LiveServer(data_dir, *flags, env=fake_recipe_env(**knobs))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def test_links_out_of_the_data_roots_are_refused(tmp_path: Path, start_server: Start) -> None:
    root = tmp_path / "datasets"
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("the secret text\n" * 400)
    (outside / "more").mkdir()
    (outside / "more" / "b.txt").write_text("more secret text\n" * 400)
    (root / "dir").mkdir(parents=True)
    (root / "dir" / "ok.txt").write_text("plain text inside the root\n" * 400)
    (root / "dir" / "leak.txt").symlink_to(secret)
    (root / "sub").mkdir()
    (root / "sub" / "ok.txt").write_text("plain text inside the root\n" * 400)
    (root / "sub" / "linked").symlink_to(outside / "more")  # a folder out of the root
    (root / "hidden").mkdir()
    (root / "hidden" / "ok.txt").write_text("plain text inside the root\n" * 400)
    (root / "hidden" / ".dot").symlink_to(secret)
    (root / "fine").mkdir()
    (root / "fine" / "a.txt").write_text("plain text inside the root\n" * 400)
    (root / "fine" / "b.txt").symlink_to(root / "dir" / "ok.txt")  # stays inside: fine
    server = start_server("--data-root", str(root))
    with server.client() as c:
        for data, entry in (
            ("dir", "leak.txt"),
            (".", "dir/leak.txt"),
            ("sub", "linked"),
            ("hidden", ".dot"),
        ):
            for path in ("/v1/jobs:validate", "/v1/jobs"):
                r = c.post(path, json=job_spec(data=data))
                assert r.status_code == 422, (data, r.text)
                body = r.json()
                assert body["errors"][0]["field"] == "body.train.data"
                assert f"'{entry}'" in body["detail"] and "outside the data roots" in body["detail"]
                assert str(outside) not in r.text and str(root) not in r.text
        assert c.get("/v1/jobs").json()["items"] == []
        # A link to a file inside a root is read like any other file.
        plan = c.post("/v1/jobs:validate", json=job_spec(data="fine"))
        assert plan.status_code == 200, plan.text
        size = (root / "fine" / "a.txt").stat().st_size
        assert plan.json()["admission"]["data"]["bytes"] == 2 * size
        assert plan.json()["admission"]["data"]["files"] == 2
        # ...and the recipe, told the roots, reads it too (it refuses links out of the folder).
        assert plan.json()["env"]["DMUON_DATA_ROOTS"] == "<data-root>"
    assert os.path.islink(root / "dir" / "leak.txt")  # nothing was changed on disk


def _wait_all(c: httpx.Client, ids: list[str], timeout: float = 90) -> list[dict]:
    def done() -> list[dict] | None:
        jobs = [c.get(f"/v1/jobs/{i}").json() for i in ids]
        return jobs if all(j["state"] in TERMINAL for j in jobs) else None

    return wait_until(done, timeout, f"jobs {ids} to finish", interval=0.1)


def test_poisoned_metrics_lines_are_skipped_and_nothing_else_stops(
    data_dir: Path, start_server: Start
) -> None:
    """A job whose metrics file holds lines no response could carry (nested 5,000 deep, a
    400-digit loss, lone surrogates) next to a clean job and a queued one: the bad lines are
    rejected once each and counted (the log shows the first and counts the rest), every job
    runs to its end, across a restart too."""
    flags = ("--max-concurrent-jobs", "2")
    server = start_server(*flags, FAKE_POISON_SEED="7", FAKE_STEP_SECONDS="0.05")
    with server.client() as c:
        poisoned = c.post("/v1/jobs", json=job_spec(1, steps=6, seed=7)).json()["id"]
        clean = c.post("/v1/jobs", json=job_spec(1, steps=3)).json()["id"]
        queued = c.post("/v1/jobs", json=job_spec(1, steps=3, seed=1)).json()["id"]
        jobs = _wait_all(c, [poisoned, clean, queued])
        assert [j["state"] for j in jobs] == ["succeeded"] * 3, jobs
        bad = jobs[0]
        assert bad["summary"]["points"] == 6 and bad["summary"]["rejected_lines"] == 4
        assert jobs[1]["summary"]["rejected_lines"] == 0
        points = c.get(f"/v1/jobs/{poisoned}/metrics").json()["items"]
        assert [p["step"] for p in points] == [1, 2, 3, 4, 5, 6]  # step 3 is the good one
        assert "x" not in points[2]
        assert c.get("/v1/jobs").status_code == 200
        prom = c.get("/metrics").text
        assert "dmuon_metric_lines_rejected_total 4" in prom
        assert "dmuon_supervision_errors_total 0" in prom
    server.stop()
    server = start_server()  # the lines are not read again
    with server.client() as c:
        again = c.get(f"/v1/jobs/{poisoned}").json()
        assert again["summary"]["rejected_lines"] == 4 and again["summary"]["points"] == 6
        assert "dmuon_metric_lines_rejected_total 0" in c.get("/metrics").text
    log = server.log_path.read_text()
    # The first rejected line of the minute is shown, the others counted, not echoed.
    assert log.count("rejected metrics line (") == 1, log[-3000:]
    assert "and 3 more rejected metrics lines" in log, log[-3000:]
    assert "Traceback" not in log


def test_without_a_token_only_the_servers_own_names_are_answered(start_server: Start) -> None:
    """DNS rebinding: a page of another site reaches a loopback port under its own name."""
    server = start_server("--allowed-host", "dmuon.lan")
    port = urlsplit(server.url).port
    assert port is not None
    evil = {"Host": f"attacker.example:{port}", "Origin": f"http://attacker.example:{port}"}
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(1, steps=1)).json()["id"]
        for method, path in (
            ("GET", "/v1/jobs"),
            ("GET", f"/v1/jobs/{job}"),
            ("POST", "/v1/jobs"),
            ("POST", f"/v1/jobs/{job}/cancel"),
            ("DELETE", f"/v1/jobs/{job}"),
            ("GET", "/healthz"),
            ("GET", "/"),
            ("GET", "/openapi.json"),
        ):
            body = job_spec(1) if method == "POST" else None
            r = c.request(method, path, json=body, headers=evil)
            assert r.status_code == 400, (method, path, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert "--allowed-host" in r.json()["detail"]
        for host in ("127.0.0.1", "localhost", "[::1]", "LocalHost.", "dmuon.lan"):
            assert c.get("/v1/jobs", headers={"Host": f"{host}:{port}"}).status_code == 200
        # Writes from a browser must come from the server's own origin.
        r = c.post("/v1/jobs:validate", json=job_spec(1), headers={"Origin": server.url})
        assert r.status_code == 200, r.text
        for origin in (f"http://attacker.example:{port}", f"http://127.0.0.1:{port + 1}", "null"):
            r = c.post("/v1/jobs", json=job_spec(1), headers={"Origin": origin})
            assert r.status_code == 403 and "Origin" in r.json()["detail"], (origin, r.text)
            r = c.delete(f"/v1/jobs/{job}", headers={"Origin": origin})
            assert r.status_code == 403
        assert [j["id"] for j in c.get("/v1/jobs").json()["items"]] == [job]
        assert c.get(f"/v1/jobs/{job}").status_code == 200
    server.stop()
    # With a token (and no --allowed-host) the token is the defence; Host is not checked.
    tokened = start_server("--token", "probe-token")
    auth = {"Authorization": "Bearer probe-token"}
    with tokened.client() as c:
        assert c.get("/v1/jobs", headers={**evil, **auth}).status_code == 200
        assert c.get("/v1/jobs", headers=evil).status_code == 401


def test_a_cancel_after_the_last_step_leaves_the_run_succeeded(start_server: Start) -> None:
    """The recipe's final evaluation and checkpoint take a moment after the last step."""
    server = start_server(
        "--max-concurrent-jobs", "2", FAKE_FINAL_SECONDS="2", FAKE_STEP_SECONDS="1"
    )
    with server.client() as c:
        finishing = c.post("/v1/jobs", json=job_spec(1, steps=3)).json()["id"]
        last_step = c.post("/v1/jobs", json=job_spec(1, steps=3, seed=1)).json()["id"]

        def at_step(job_id: str, step: int) -> bool:
            return (c.get(f"/v1/jobs/{job_id}").json()["summary"]["last_step"] or 0) >= step

        # Cancelled during the last step: accepted; the recipe finishes that step, saves it
        # and stops, having trained every step.
        wait_until(lambda: at_step(last_step, 2), 60, "step 2")
        assert c.post(f"/v1/jobs/{last_step}/cancel").status_code == 202
        # Cancelled in the final phase: refused, the run ends as it would have.
        wait_until(lambda: at_step(finishing, 3), 60, "the last step")
        r = c.post(f"/v1/jobs/{finishing}/cancel")
        assert r.status_code == 409 and "trained all its 3 steps" in r.json()["detail"], r.text
        jobs = _wait_all(c, [finishing, last_step])
        assert [j["state"] for j in jobs] == ["succeeded", "succeeded"], jobs
        assert jobs[0]["exit_code"] == 0 and not jobs[0]["cancel_requested"]
        assert "the cancel came after" in jobs[1]["reason"], jobs[1]
        assert [p["step"] for p in c.get(f"/v1/jobs/{last_step}/metrics").json()["items"]] == [
            1,
            2,
            3,
        ]
        for job_id in (finishing, last_step):
            r = c.post(f"/v1/jobs/{job_id}/resume")
            assert r.status_code == 409 and r.json()["title"] == "Nothing left to train"


def test_a_job_killed_after_its_grace_while_the_server_was_down_has_an_exit_code(
    start_server: Start,
) -> None:
    server = start_server("--cancel-grace-s", "1", FAKE_IGNORE_SIGTERM="1")
    with server.client() as c:
        job = c.post("/v1/jobs", json=job_spec(1, steps=100_000)).json()["id"]
        wait_until(lambda: c.get(f"/v1/jobs/{job}").json()["state"] == "running", 60, "running")
        assert c.post(f"/v1/jobs/{job}/cancel").status_code == 202
    server.kill()
    time.sleep(1.5)  # the grace period ends while no server watches the job
    server = start_server("--cancel-grace-s", "1", FAKE_IGNORE_SIGTERM="1")
    with server.client() as c:
        done = _wait_all(c, [job])[0]
    assert done["state"] == "cancelled" and done["exit_code"] == -9, done
    assert "SIGKILL after the grace period" in done["reason"]
    assert not processes_of_job(job)


def test_bodies_are_json_once_names_are_plain_and_head_answers(start_server: Start) -> None:
    server = start_server()
    spec = job_spec(1, steps=1)
    with server.client() as c:
        text = json.dumps(spec)
        for headers in (
            {},
            {"Content-Type": "text/plain"},
            {"Content-Type": "application/x-www-form-urlencoded"},
        ):
            r = c.post("/v1/jobs:validate", content=text, headers=headers)
            assert r.status_code == 415, (headers, r.text)
            assert "Content-Type: application/json" in r.json()["detail"]
        ok = {"Content-Type": "application/json; charset=utf-8"}
        assert c.post("/v1/jobs:validate", content=text, headers=ok).status_code == 200
        # A key given twice is refused, wherever it is.
        twice = text.replace('"steps": 1', '"steps": 10, "steps": 99999999')
        r = c.post("/v1/jobs", content=twice, headers=ok)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.train.steps"
        assert r.json()["errors"][0]["type"] == "duplicate_key"
        r = c.post("/v1/jobs", content='{"nproc_per_node": 1, "nproc_per_node": 2}', headers=ok)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.nproc_per_node"
        # Nested too deep to read; a lone surrogate; names that would pass for others.
        r = c.post("/v1/jobs", content="[" * 5000 + "]" * 5000, headers=ok)
        assert r.status_code == 400 and r.json()["title"] == "Malformed request body"
        r = c.post("/v1/jobs", content=text.replace("{", '{"name": "a\\ud800b", ', 1), headers=ok)
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.name", r.text
        for name in ("admin\u202etxt.exe", "c1\x85control", "two\u2028lines", "zero\u200bwidth"):
            r = c.post("/v1/jobs", json={**spec, "name": name})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body.name", name
        assert c.post("/v1/jobs:validate", json={**spec, "name": "ünïcode 名前 ok"}).is_success
        assert c.get("/v1/jobs").json()["items"] == []
        # No interactive API pages (they loaded Swagger UI from a CDN); the document stays.
        for path in ("/docs", "/redoc"):
            assert c.get(path).status_code == 404
        assert c.get("/openapi.json").status_code == 200
        # HEAD answers as GET does, without a body; an event stream too, at once.
        job = c.post("/v1/jobs", json=job_spec(1, steps=100_000)).json()["id"]
        for path in ("/v1/jobs", f"/v1/jobs/{job}", "/healthz", f"/v1/jobs/{job}/logs", "/"):
            got, head = c.get(path), c.head(path)
            assert head.status_code == got.status_code == 200, (path, head.status_code)
            assert (
                head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
            )
        t0 = time.monotonic()
        head = c.head(f"/v1/jobs/{job}/events")
        assert head.status_code == 200 and head.headers["content-type"].startswith(
            "text/event-stream"
        )
        assert time.monotonic() - t0 < 5
        assert c.head("/v1/jobs/nope").status_code == 404
        assert c.post(f"/v1/jobs/{job}/cancel").status_code == 202


def test_logs_hide_the_installation_and_resumed_jobs_queue_at_the_end(
    data_dir: Path, start_server: Start
) -> None:
    crash = {"FAKE_CRASH_RANK": "0", "FAKE_CRASH_STEP": "3", "FAKE_CRASH_SEED": "9"}
    server = start_server(FAKE_STEP_SECONDS="0.05", **crash)
    hidden = {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix}
    with server.client() as c:
        crashed = c.post("/v1/jobs", json=job_spec(1, steps=5, seed=9)).json()["id"]
        done = _wait_all(c, [crashed])[0]
        assert done["state"] == "failed"
        logs = c.get(f"/v1/jobs/{crashed}/logs", params={"tail": 1000}).text
        shown = json.dumps(done["failure"]) + logs
        assert "fake_train runs <python> with <python-home>/lib/" in logs, logs[-2000:]
        assert any("fake_train runs <python>" in line for line in done["failure"]["log_tail"])
        assert not [p for p in hidden if p in shown], shown[-2000:]
        short = c.post("/v1/jobs", json=job_spec(1, steps=2)).json()["id"]
        _wait_all(c, [short])
        running = c.post("/v1/jobs", json=job_spec(1, steps=100_000)).json()["id"]
        wait_until(lambda: c.get(f"/v1/jobs/{running}").json()["state"] == "running", 60, "run")
        waiting = c.post("/v1/jobs", json=job_spec(1, steps=100_000, seed=1)).json()["id"]
        # Resumed after `waiting` was queued: it stands behind it, not by its older id.
        resumed = c.post(f"/v1/jobs/{short}/resume", json={"steps": 4})
        assert resumed.status_code == 202 and resumed.json()["queue_position"] == 2
        assert c.get(f"/v1/jobs/{waiting}").json()["queue_position"] == 1
        for job_id in (short, waiting, running):
            c.post(f"/v1/jobs/{job_id}/cancel")
