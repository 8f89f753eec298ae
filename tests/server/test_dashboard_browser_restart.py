"""The dashboard in a real browser (Debian's Chromium driven by Playwright) across a graceful
server restart, against a ``dmuon-server`` process without a token (so the page's writes
pass the server's ``Origin`` check) whose jobs run the fake recipe.

The oracle is the REST API read with httpx, and the requests the page makes.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from server_helpers import (
    LiveServer,
    fake_recipe_env,
    job_spec,
    kill_job_processes,
    processes_of_job,
    wait_until,
)

try:
    from playwright.sync_api import Page, expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None  # type: ignore[assignment]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _missing() -> str | None:
    if sync_playwright is None:
        return "Playwright's Python package is not installed (pip install -r requirements-dev.txt)"
    if CHROMIUM is None:
        return "no system Chromium (apt-get install -y chromium)"
    if importlib.util.find_spec("dmuon_server") is None:
        return "dmuon-server is not installed"
    return None


pytestmark = pytest.mark.skipif(
    not IN_CI and _missing() is not None, reason=f"browser tests skipped: {_missing()}"
)

#: Knobs of the fake recipe: quick steps, then a final phase long enough to restart the
#: server in while the job still runs.
KNOBS = {"FAKE_STEP_SECONDS": "0.2", "FAKE_FINAL_SECONDS": "5"}


class Service:
    """A server without a token; :meth:`restart` stops it gracefully and starts it again
    on the same port."""

    def __init__(self, data_dir: Path) -> None:
        """Start it on a free port."""
        self.data_dir = data_dir
        self.server = self._start("0")
        self.url = self.server.url
        self.port = urlsplit(self.url).port

    def _start(self, port: str) -> LiveServer:
        server = LiveServer(
            self.data_dir,
            *("--heartbeat", "1", "--max-concurrent-jobs", "3", "--port", port),
            env=fake_recipe_env(**KNOBS),
        )
        return server.start()

    def stop(self) -> None:
        """SIGTERM: every open event stream gets ``end`` with ``server_shutdown``."""
        self.server.stop()

    def start_again(self) -> None:
        """Start on the same port."""
        self.server = self._start(str(self.port))
        assert self.server.url == self.url

    def client(self) -> httpx.Client:
        """An httpx client."""
        return httpx.Client(base_url=self.url, timeout=30)

    def job(self, job_id: str) -> dict[str, Any]:
        """The job as the API shows it."""
        with self.client() as c:
            return c.get(f"/v1/jobs/{job_id}").json()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    """The server of one test."""
    svc = Service(tmp_path / "data")
    try:
        yield svc
    finally:
        svc.server.stop()
        kill_job_processes(svc.data_dir)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module."""
    missing = _missing()
    if missing is not None:
        pytest.fail(f"CI must run the browser tests: {missing}")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def browser_context(browser: Any) -> Iterator[Any]:
    """A fresh context (1280x900) of the browser; uncaught errors of its pages fail the test."""
    errors: list[str] = []
    context = browser.new_context(viewport={"width": 1280, "height": 900}, locale="en-US")
    context.set_default_timeout(30_000)
    context.on("page", lambda page: page.on("pageerror", lambda e: errors.append(str(e))))
    try:
        yield context
    finally:
        context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def drawn_steps(page: Page) -> list[int]:
    """The x values (steps) the loss chart draws."""
    steps: list[int] = page.evaluate(
        "() => Array.from(document.querySelector('#chart-loss')._uplot.data[0])"
    )
    return steps


def wait_drawn(page: Page, count: int, timeout: int = 60_000) -> None:
    """Wait until the loss chart draws at least ``count`` points."""
    page.wait_for_function(
        "n => { const el = document.querySelector('#chart-loss');"
        " return el && el._uplot && el._uplot.data[0].length >= n; }",
        arg=count,
        timeout=timeout,
    )


def test_pages_follow_their_jobs_across_a_graceful_restart(
    service: Service, browser_context: Any
) -> None:
    with service.client() as c:
        ending = c.post("/v1/jobs", json=job_spec(1, "ending", steps=8)).json()["id"]
        long = c.post("/v1/jobs", json=job_spec(1, "long", steps=100_000)).json()["id"]
    ending_tab, long_tab = browser_context.new_page(), browser_context.new_page()
    ending_tab.goto(f"{service.url}/#/job/{ending}")
    long_tab.goto(f"{service.url}/#/job/{long}")
    wait_drawn(ending_tab, 8)  # every step; the job is in its final phase now
    wait_drawn(long_tab, 3)
    for tab in (ending_tab, long_tab):
        expect(tab.locator("#stream-status")).to_have_attribute("data-status", "open")
    assert service.job(ending)["state"] == "running"

    service.stop()  # graceful: the streams end with reason server_shutdown
    for tab in (ending_tab, long_tab):
        expect(tab.locator("#stream-status")).to_have_attribute("data-status", "reconnecting")
    shown = len(drawn_steps(long_tab))
    # The ending job finishes while no server runs; the long one goes on.
    wait_until(lambda: not processes_of_job(ending), 30, "the ending job's processes to exit")
    service.start_again()

    # The long job's page resumes after the last step it had, without a gap.
    wait_drawn(long_tab, shown + 5)
    expect(long_tab.locator("#stream-status")).to_have_attribute("data-status", "open")
    steps = drawn_steps(long_tab)
    assert steps == list(range(1, len(steps) + 1)), "gap or duplicate after the reconnect"
    # The ending job's reconnect is answered 204 (nothing left to send): the page shows the
    # state the job ended in.
    assert service.job(ending)["state"] == "succeeded"
    expect(ending_tab.locator("#job-state .state")).to_have_attribute("data-state", "succeeded")
    expect(ending_tab.locator("#stream-status")).to_have_attribute("data-status", "ended")
    assert drawn_steps(ending_tab) == list(range(1, 9))

    # Compare the two: the finished job's points are fetched once, the running one's again
    # only after the last point the page has.
    metrics_requests: list[str] = []
    cmp = browser_context.new_page()
    cmp.on("request", lambda r: metrics_requests.append(r.url) if "/metrics?" in r.url else None)
    cmp.goto(f"{service.url}/#/compare?ids={ending},{long}")
    cmp.wait_for_function(
        "() => { const el = document.querySelector('#chart-cmp-step');"
        " return el && el._uplot && el._uplot.data[0].length > 8; }"
    )
    for _ in range(150):  # Playwright delivers the page's events while it waits itself
        if sum(long in u for u in metrics_requests) >= 2:
            break
        cmp.wait_for_timeout(100)
    ending_requests = [u for u in metrics_requests if ending in u]
    assert len(ending_requests) == 1, ending_requests
    afters = [
        int(parse_qs(urlsplit(u).query)["after_step"][0]) for u in metrics_requests if long in u
    ]
    assert afters[0] == -1 and all(a > 0 for a in afters[1:]), afters
    with service.client() as c:
        c.post(f"/v1/jobs/{long}/cancel")


def test_submit_form_groups_and_the_pair_under_the_name_limit(
    service: Service, browser_context: Any
) -> None:
    page = browser_context.new_page()
    page.goto(f"{service.url}/#/submit")
    expect(page.locator("#field-train-steps")).to_be_visible()
    legends = page.locator("#submit-form legend").all_inner_texts()
    assert "Recipe settings (train)" in legends
    assert "Start from another job's checkpoint (init_from)" in legends, legends
    # A name at the schema's limit: the pair's suffixes keep both within it.
    with service.client() as c:
        limit = c.get("/openapi.json").json()["components"]["schemas"]["JobCreate"]
    max_name = limit["properties"]["name"]["anyOf"][0]["maxLength"]
    spec = job_spec(1, "n" * max_name, steps=2)
    page.fill("#field-name", spec["name"])
    page.fill("#field-nproc_per_node", "1")
    for key, value in spec["train"].items():
        selector = f"#field-train-{key}"
        if page.locator(selector).evaluate("el => el.tagName") == "SELECT":
            page.select_option(selector, str(value))
        else:
            page.fill(selector, str(value))
    page.click("#submit-pair")
    page.wait_for_url("**/#/compare?ids=*")
    ids = page.url.split("ids=", 1)[1].split(",")
    names = [service.job(i)["name"] for i in ids]
    assert [n.rsplit(" ", 1)[1] for n in names] == ["dmuon", "adamw"], names
    assert all(len(n) <= max_name for n in names), [len(n) for n in names]


SCRIPT = """\
import json, os, time
steps = int(os.environ["DMUON_STEPS"])
if os.environ.get("RANK", "0") == "0":
    with open(os.environ["DMUON_METRICS_FILE"], "a") as f:
        for step in range(1, steps + 1):
            point = {"step": step, "loss": 1.0 / step, "samples_per_s": 10.0 * step}
            f.write(json.dumps(point) + "\\n")
            f.flush()
            time.sleep(0.05)
"""


def test_users_queue_reasons_and_script_jobs_on_the_dashboard(
    tmp_path: Path, browser_context: Any
) -> None:
    import hashlib
    import json as _json

    users = tmp_path / "users.json"
    users.write_text(_json.dumps({"users": [
        {"name": "ada", "token_sha256": hashlib.sha256(b"t-ada").hexdigest()},
        {"name": "root", "token_sha256": hashlib.sha256(b"t-root").hexdigest(), "admin": True},
    ]}))  # fmt: skip
    users.chmod(0o600)
    code = tmp_path / "code"
    code.mkdir()
    (code / "own.py").write_text(SCRIPT)
    flags = (
        "--users-file",
        str(users),
        "--gpus",
        "0,1",
        "--code-root",
        str(code),
        "--max-nproc",
        "2",
    )
    server = LiveServer(tmp_path / "data", *flags, env=fake_recipe_env(FAKE_STEP_SECONDS="0.2"))
    server.start()
    try:
        ada = server.client(headers={"Authorization": "Bearer t-ada"})
        busy = ada.post("/v1/jobs", json=job_spec(2, "holds both", steps=100_000)).json()["id"]
        wait_until(lambda: ada.get(f"/v1/jobs/{busy}").json()["state"] == "running", 60, "running")
        waiting = ada.post("/v1/jobs", json=job_spec(2, "waits")).json()
        assert waiting["queue_reason"] == "waiting for 2 GPUs: 0 free"
        page = browser_context.new_page()
        page.goto(f"{server.url}/#/jobs")
        page.locator("#token-input").fill("t-root")
        page.keyboard.press("Enter")
        row = page.locator(f"#jobs-table tr[data-job-id='{waiting['id']}']")
        expect(row.locator(".user")).to_have_text("ada")
        expect(row.locator(".queue-reason")).to_have_text("waiting for 2 GPUs: 0 free")
        expect(page.locator("#user-filter")).to_be_visible()
        page.select_option("#user-filter", "root")  # root has no jobs
        page.wait_for_url("**/#/jobs?user=root")
        expect(page.locator("#jobs-table tbody tr")).to_have_count(0)
        page.goto(f"{server.url}/#/job/{waiting['id']}")
        expect(page.locator("#job-queue")).to_have_text(
            "Queue position 1: waiting for 2 GPUs: 0 free"
        )
        expect(page.locator("#job-meta")).to_contain_text("user ada")
        # A script job: its own series gets a chart of its own.
        ada.post(f"/v1/jobs/{busy}/cancel")
        spec = {"nproc_per_node": 1, "gpus_per_node": 0, "script": {"path": "own.py", "steps": 6}}
        own = ada.post("/v1/jobs", json=spec).json()["id"]
        page.goto(f"{server.url}/#/job/{own}")
        page.wait_for_function(
            "() => { const el = document.querySelector('#chart-extra-samples_per_s');"
            " return el && el._uplot && el._uplot.data[0].length === 6; }",
            timeout=60_000,
        )
        values = page.evaluate(
            "() => Array.from(document.querySelector('#chart-extra-samples_per_s')._uplot.data[1])"
        )
        assert values == [10.0 * s for s in range(1, 7)]
        expect(page.locator("#job-spec")).to_contain_text('"path": "own.py"')
        # The form starts from the newest job, the script one: its group is the one shown;
        # the switch brings the recipe's back, and takes it away again.
        page.goto(f"{server.url}/#/submit")
        expect(page.locator("#prefill-note")).to_be_visible()
        expect(page.locator("#group-script")).to_be_visible()
        expect(page.locator("#group-train")).to_be_hidden()
        assert page.input_value("#field-script-path") == "own.py"
        page.check("#kind-train")
        expect(page.locator("#group-train")).to_be_visible()
        expect(page.locator("#group-script")).to_be_hidden()
        page.check("#kind-script")
        expect(page.locator("#group-train")).to_be_hidden()
        expect(page.locator("#group-init_from")).to_be_hidden()
        page.fill("#field-script-path", "own.py")
        page.fill("#field-script-args", "--one\n--two")
        expect(page.locator("#dry-run-ok")).to_be_attached()
        expect(page.locator("[data-plan='plan.cmd']")).to_contain_text("own.py --one --two")
        ada.close()
    finally:
        server.stop()
        kill_job_processes(tmp_path / "data")
