"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a real
``dmuon-server`` process (with a token) that runs the real recipe (``tiny`` preset).

One server and one browser page serve the whole module, so the tests run in file order
and later ones look at jobs earlier ones made. The oracle for what the page shows is the
REST API itself, read with httpx, and arithmetic on the job spec.

Screenshots of every page, light and dark, desktop and 390 px wide, are written to
``test-artifacts/dashboard/`` at the repository root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import LiveServer, job_spec, kill_job_processes, wait_until

try:
    from playwright.sync_api import Page, Request, Route, expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None  # type: ignore[assignment]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IN_CI = os.environ.get("CI", "").lower() == "true"
TOKEN = "dashboard-test-token"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
#: Screenshots for the documentation (the top of the page only): (page, theme, width).
DOCS_SHOTS = {
    ("jobs", "light", 1280),
    ("job", "dark", 1280),
    ("compare", "light", 1280),
    ("submit", "light", 390),
}
#: Generous: a loaded 2-core machine starts torchrun and torch in tens of seconds.
JOB_TIMEOUT_MS = 240_000


def _missing() -> str | None:
    if sync_playwright is None:
        return "Playwright's Python package is not installed (pip install -r requirements-dev.txt)"
    if CHROMIUM is None:
        return "no system Chromium (apt-get install -y chromium)"
    if importlib.util.find_spec("dmuon") is None:
        return "the recipe (dmuon) is not installed"
    return None


# Outside CI a missing browser skips these tests; in CI it fails them (see the fixture).
pytestmark = pytest.mark.skipif(
    not IN_CI and _missing() is not None, reason=f"browser tests skipped: {_missing()}"
)


def tiny_spec(name: str, steps: int, **train: Any) -> dict[str, Any]:
    """A one-process ``tiny`` job of the real recipe (`job_spec` with quick settings)."""
    quick: dict[str, Any] = {"accum_steps": 1, "eval_every": 0, "warmup_steps": 1}
    return job_spec(1, name, **{**quick, "steps": steps, **train})


class Service:
    """The server under test; :meth:`restart` brings it back on the same port."""

    def __init__(self, data_dir: Path) -> None:
        """Start a server with a token on a free port."""
        self.data_dir = data_dir
        self.env = {k: v for k, v in os.environ.items() if k != "DMUON_SERVER_TRAIN_MODULE"}
        self.server = self._start("0")
        self.port = urlsplit(self.server.url).port
        self.url = self.server.url

    def _start(self, port: str) -> LiveServer:
        # The server and its jobs (which inherit this) get one CPU of their own: the
        # recipe then runs one thread, and neither it nor the browser starves the other.
        cpus = sorted(os.sched_getaffinity(0))
        server = LiveServer(
            self.data_dir,
            *("--token", TOKEN, "--max-nproc", "2", "--max-concurrent-jobs", "2"),
            *("--heartbeat", "1", "--port", port),
        )
        server.env = self.env
        if len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[-1]})
        try:
            return server.start(timeout=90)
        finally:
            os.sched_setaffinity(0, set(cpus))

    def restart(self) -> None:
        """SIGKILL the server (its jobs keep running) and start it again, same port."""
        self.server.kill()
        self.server = self._start(str(self.port))
        assert self.server.url == self.url

    def client(self) -> httpx.Client:
        """An httpx client with the token."""
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )

    def job(self, job_id: str) -> dict[str, Any]:
        """The job as the API shows it."""
        with self.client() as c:
            return c.get(f"/v1/jobs/{job_id}").json()

    def steps(self, job_id: str) -> list[int]:
        """Steps of every stored metric point of a job, in order (the API's paging)."""
        out: list[int] = []
        after = -1
        with self.client() as c:
            while True:
                page = c.get(
                    f"/v1/jobs/{job_id}/metrics", params={"after_step": after, "limit": 10000}
                ).json()
                out += [p["step"] for p in page["items"]]
                if page["next"] is None:
                    return out
                after = page["next"]

    def stop(self) -> None:
        """Stop the server and every job process it left."""
        self.server.stop()
        kill_job_processes(self.data_dir)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One real server for the module."""
    svc = Service(tmp_path_factory.mktemp("dashboard") / "data")
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def requests_made() -> list[str]:
    """Every URL the browser requested, over the whole module."""
    return []


@pytest.fixture(scope="module")
def page(service: Service, requests_made: list[str]) -> Iterator[Page]:
    """One Chromium tab (1280x900) recording every request it makes."""
    missing = _missing()
    if missing is not None:
        pytest.fail(f"CI must run the browser tests: {missing}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 900}, locale="en-US")
        context.set_default_timeout(30_000)
        context.on("request", lambda r: requests_made.append(r.url))
        tab = context.new_page()
        errors: list[str] = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        try:
            yield tab
        finally:
            browser.close()
        assert not errors, f"uncaught errors in the page: {errors}"


def drawn_steps(page: Page, chart: str = "#chart-loss") -> list[int]:
    """The x values (steps) the chart draws: the data handed to uPlot."""
    steps: list[int] = page.evaluate(
        "sel => Array.from(document.querySelector(sel)._uplot.data[0])", chart
    )
    return steps


def wait_drawn(page: Page, count: int, chart: str = "#chart-loss", timeout: int = 60_000) -> None:
    """Wait until the chart draws at least ``count`` points."""
    page.wait_for_function(
        "([sel, n]) => { const el = document.querySelector(sel);"
        " return el && el._uplot && el._uplot.data[0].length >= n; }",
        arg=[chart, count],
        timeout=timeout,
    )


def open_hash(page: Page, service: Service, route: str) -> None:
    """Show the dashboard page ``route`` (``#/jobs`` ...)."""
    page.goto(f"{service.url}/{route}")


def fill_form(page: Page, spec: dict[str, Any]) -> None:
    """Type a spec into the submit form, one field at a time."""
    page.fill("#field-name", spec["name"])
    page.fill("#field-nproc_per_node", str(spec["nproc_per_node"]))
    for key, value in spec["train"].items():
        selector = f"#field-train-{key}"
        if page.locator(selector).evaluate("el => el.tagName") == "SELECT":
            page.select_option(selector, str(value))
        else:
            page.fill(selector, str(value))


def test_submit_through_form_and_watch_it_run(page: Page, service: Service) -> None:
    page.goto(service.url + "/")
    # The server has a token: the page asks once (keyboard only), then lists jobs.
    expect(page.locator("#token-dialog")).to_be_visible()
    page.keyboard.type(TOKEN)
    page.keyboard.press("Enter")
    expect(page.locator("#token-dialog")).to_be_hidden()
    # The dialog's "close" event, which keeps the token, is a task of its own after the
    # dialog hides: wait for it rather than read the storage at once.
    page.wait_for_function("t => sessionStorage.getItem('dmuon.token') === t", arg=TOKEN)
    expect(page.locator("#jobs-table")).to_be_visible()

    page.click("a[data-nav=submit]")
    expect(page.locator("#field-train-steps")).to_be_visible()
    # Bounds come from the server's OpenAPI schema (--max-nproc 2), not from the page.
    assert page.get_attribute("#field-nproc_per_node", "max") == "2"
    spec = tiny_spec("form-tiny", steps=60, eval_every=20)
    fill_form(page, spec)
    t = spec["train"]
    tokens_per_step = t["micro_batch_size"] * t["accum_steps"] * t["seq_len"] * 1
    expect(page.locator("[data-plan='plan.tokens_step']")).to_have_text(str(tokens_per_step))
    expect(page.locator("[data-plan='plan.world']")).to_have_text("1")
    page.click("#submit-job")
    page.wait_for_url("**/#/job/*")
    job_id = page.url.rsplit("/", 1)[1]
    assert service.job(job_id)["name"] == "form-tiny"

    # The curve gains points while the job runs.
    wait_drawn(page, 1, timeout=JOB_TIMEOUT_MS)
    first = len(drawn_steps(page))
    assert first < 61, "the job finished before the page saw it run; use more steps"
    wait_drawn(page, first + 1)

    # It is in the table, and ends as succeeded there and on its page.
    page.click("a[data-nav=jobs]")
    row = page.locator(f"#jobs-table tr[data-job-id='{job_id}']")
    expect(row).to_contain_text("form-tiny")
    expect(row).to_have_attribute("data-state", "succeeded", timeout=JOB_TIMEOUT_MS)
    row.get_by_role("link", name="form-tiny").click()
    expect(page.locator("#job-state .state")).to_have_attribute("data-state", "succeeded")
    wait_drawn(page, 61)
    # Step 0 is the first evaluation (val loss only), then one point per optimizer step.
    assert drawn_steps(page) == service.steps(job_id) == list(range(0, 61))
    job = service.job(job_id)
    expect(page.locator("#tile-step dd")).to_have_text(f"{job['summary']['last_step']} / 60")
    expect(page.locator("#job-history")).to_contain_text("succeeded")
    # The job's checkpoints and its one attempt, as the API lists them; a succeeded job
    # has no Resume button (resuming it needs more steps).
    with service.client() as c:
        steps = [k["step"] for k in c.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]]
    assert steps and steps[-1] == 60
    panel = page.locator("#job-checkpoints")
    expect(panel).to_be_visible()
    expect(panel.locator("tbody tr")).to_have_count(len(steps))
    expect(page.locator("#job-attempts tbody tr")).to_have_count(1)
    expect(page.locator("#resume-job")).to_be_hidden()
    assert_finished_job_reads_well(page, service, job)


def assert_finished_job_reads_well(page: Page, service: Service, job: dict[str, Any]) -> None:
    """A finished job's page: tokens/s grouped as the API's number rounds, no ETA, the
    attempts table in words with local times, the log opened at its newest line, the
    account the job ran as, and both learning rates on one chart."""
    tps = round(job["summary"]["tokens_per_s"])
    expected = f"{tps:,}" if tps >= 1000 else None
    if expected is not None:
        expect(page.locator("#tile-tps dd")).to_have_text(expected)
    expect(page.locator("#tile-eta dd")).to_have_text("—")
    headers = page.locator("#job-attempts thead th").all_inner_texts()
    assert headers[:3] == ["#", "Cause", "Resumed from step"], headers
    assert all("_" not in h for h in headers), headers
    started = page.locator("#job-attempts th[data-key=started_at]")
    expect(started).to_have_text("Started")
    column = page.locator("#job-attempts thead th").all_inner_texts().index("Started")
    cell = page.locator("#job-attempts tbody tr td").nth(column).inner_text()
    assert "T" not in cell and cell != job["attempts"][0]["started_at"], cell
    logs = page.locator("#job-logs")
    expect(logs).not_to_be_empty()
    at_end = logs.evaluate("el => el.scrollTop + el.clientHeight >= el.scrollHeight - 4")
    assert at_end, "the log opened at its oldest lines"
    expect(page.locator("#log-hidden")).to_be_hidden()  # nothing of torch's noise to hide
    # The real account beside the token's user name: the server's own, started here.
    assert job["runs_as"] == pwd.getpwuid(os.geteuid()).pw_name
    expect(page.locator("#job-meta")).to_contain_text(f"runs as {job['runs_as']}")
    # Both learning rates on one chart, each as the metrics hold it.
    lr = "document.querySelector('#chart-lr')._uplot"
    labels = page.evaluate(f"() => {lr}.series.slice(1).map(s => s.label)")
    assert labels == ["Muon (lr)", "AdamW (adamw_lr)"], labels
    drawn = page.evaluate(f"() => [Array.from({lr}.data[1]), Array.from({lr}.data[2])]")
    with service.client() as c:
        params = {"after_step": -1, "limit": 10000}
        points = c.get(f"/v1/jobs/{job['id']}/metrics", params=params).json()["items"]
    assert drawn == [[p.get("lr") for p in points], [p.get("adamw_lr") for p in points]]
    assert any(v is not None for v in drawn[1]), "no AdamW rate was drawn"


def test_torchs_socket_warnings_leave_the_first_screen_of_a_log(
    page: Page, service: Service
) -> None:
    """The job page's filter, run in Chromium on lines as torch prints them: the warning
    goes, every other line stays, in order."""
    page.goto(service.url + "/")
    noise = (
        "[W1204 10:00:00.123456 4242 socket.cpp:767] [c10d] The hostname of the client "
        "socket cannot be retrieved. err=-3"
    )
    lines = [
        "step 1 loss 5.5",
        noise,
        "step 2 loss 5.1",
        noise,
        "Traceback (most recent call last):",
    ]
    result = page.evaluate(
        "async lines => (await import('/ui/js/util.js')).withoutNoise(lines)", lines
    )
    assert result == {"shown": [lines[0], lines[2], lines[4]], "hidden": 2}


def assert_form_holds(page: Page, job: dict[str, Any]) -> None:
    """Every field of the submit form shows ``job``'s value of that spec field."""
    shown = page.eval_on_selector_all(
        "#submit-form [id^=field-]", "els => Object.fromEntries(els.map(e => [e.id, e.value]))"
    )
    assert "field-max_restarts" in shown and "field-train-steps" in shown, shown
    for field_id, value in shown.items():
        expected: Any = job
        for key in field_id.removeprefix("field-").split("-"):
            expected = expected.get(key) if isinstance(expected, dict) else None
        if expected is None:
            assert value == "", (field_id, value)
        elif isinstance(expected, bool):
            assert value == str(expected).lower(), (field_id, value, expected)
        elif isinstance(expected, int | float):
            assert float(value) == expected, (field_id, value, expected)
        else:
            assert value == str(expected), (field_id, value, expected)


def api_errors(service: Service, body: dict[str, Any]) -> dict[str, str]:
    """The field errors the API itself gives for ``body``: {field: message}."""
    with service.client() as c:
        r = c.post("/v1/jobs:validate", json=body)
    assert r.status_code == 422, r.text
    return {e["field"]: e["message"] for e in r.json()["errors"]}


def test_invalid_spec_shows_the_field_error(page: Page, service: Service) -> None:
    with service.client() as c:
        jobs_before = len(c.get("/v1/jobs").json()["items"])
    open_hash(page, service, "#/submit")
    expect(page.locator("#field-train-steps")).to_be_visible()
    expect(page.locator("#prefill-note")).to_contain_text("form-tiny")  # the newest job
    with service.client() as c:
        newest = c.get("/v1/jobs", params={"limit": 1}).json()["items"][0]
    assert_form_holds(page, newest)
    # A bound of the schema (steps >= 1), then a limit of this server (--max-nproc 2).
    bad = tiny_spec("bad", steps=0)
    fill_form(page, bad)
    page.click("#submit-job")
    steps_error = page.locator("#err-field-train-steps")
    expect(steps_error).to_have_text(api_errors(service, bad)["body.train.steps"])
    expect(page.locator("#field-train-steps")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#field-name")).not_to_have_attribute("aria-invalid", "true")

    bad = tiny_spec("bad", steps=5)
    bad["nproc_per_node"] = 99
    fill_form(page, bad)
    page.click("#submit-job")
    nproc_error = page.locator("#err-field-nproc_per_node")
    expect(nproc_error).to_have_text(api_errors(service, bad)["body.nproc_per_node"])
    expect(nproc_error).to_contain_text("at most 2")
    expect(steps_error).to_be_hidden()
    expect(page.locator("#field-train-steps")).not_to_have_attribute("aria-invalid", "true")
    with service.client() as c:
        assert len(c.get("/v1/jobs").json()["items"]) == jobs_before


def test_a_late_prefill_never_overwrites_what_was_typed(page: Page, service: Service) -> None:
    """The form appears only after its prefill (the newest job) has arrived, so a slow
    ``GET /v1/jobs?limit=1`` cannot replace values someone typed in the meantime."""
    with service.client() as c:
        newest = c.get("/v1/jobs", params={"limit": 1}).json()["items"][0]
    open_hash(page, service, "#/jobs")
    expect(page.locator("#jobs-table")).to_be_visible()

    held: list[Route] = []

    def is_prefill(url: str) -> bool:
        parts = urlsplit(url)
        return parts.path == "/v1/jobs" and parts.query == "limit=1"

    def hold(route: Route) -> None:
        held.append(route)

    page.route(is_prefill, hold)
    try:
        open_hash(page, service, "#/submit")

        def prefill_held() -> bool:
            page.wait_for_timeout(20)  # Playwright runs route handlers only inside its calls
            return bool(held)

        wait_until(prefill_held, timeout=30, what="the form's prefill request")
        page.wait_for_timeout(300)  # the schema has long arrived; the prefill is held
        expect(page.locator("#field-name")).to_have_count(0)
        held[0].continue_()
        expect(page.locator("#field-name")).to_have_value(newest["name"])
        page.fill("#field-name", "typed by hand")
        page.wait_for_timeout(300)
        expect(page.locator("#field-name")).to_have_value("typed by hand")
    finally:
        page.unroute(is_prefill)


def test_dmuon_vs_adamw_pair_and_compare(page: Page, service: Service) -> None:
    open_hash(page, service, "#/submit")
    expect(page.locator("#field-train-steps")).to_be_visible()
    # qk_clip is Muon's alone (marked so in the schema): the AdamW run goes without it.
    fill_form(page, tiny_spec("pair", steps=12, qk_clip=1000))
    page.click("#submit-pair")
    page.wait_for_url("**/#/compare?ids=*")
    ids = page.url.split("ids=", 1)[1].split(",")
    assert len(ids) == 2
    jobs = [service.job(i) for i in ids]
    assert [j["train"]["optimizer"] for j in jobs] == ["dmuon", "adamw"]
    assert [j["train"]["qk_clip"] for j in jobs] == [1000, None]
    assert [j["name"] for j in jobs] == ["pair dmuon", "pair adamw"]
    for job_id in ids:
        expect(page.locator(f"#compare-table tr[data-job-id='{job_id}'] .state")).to_have_attribute(
            "data-state", "succeeded", timeout=JOB_TIMEOUT_MS
        )
    wait_drawn(page, 12, "#chart-cmp-step")
    assert drawn_steps(page, "#chart-cmp-step") == list(range(1, 13))
    # Against tokens: step x tokens per step (micro-batch x accumulation x seq_len x ranks).
    per_step = 2 * 1 * 32 * 1
    assert drawn_steps(page, "#chart-cmp-tokens") == [s * per_step for s in range(1, 13)]
    curves = page.evaluate(
        "document.querySelector('#chart-cmp-step')._uplot.data.slice(1).map((a) => Array.from(a))"
    )
    with service.client() as c:
        for job_id, curve in zip(ids, curves, strict=True):
            points = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
            assert curve == pytest.approx([p["loss"] for p in points], rel=1e-12)
            final = points[-1]["loss"]
            row = page.locator(f"#compare-table tr[data-job-id='{job_id}']")
            expect(row).to_contain_text(f"{float(f'{final:.4g}')}")
    assert curves[0] != curves[1]  # two optimizers, two curves


def test_samples_show_on_the_job_page_as_the_recipe_wrote_them(
    page: Page, service: Service
) -> None:
    """Oracle: the sample lines of the job's metrics file (the recipe's own record)."""
    spec = tiny_spec("samples", steps=4, sample_every=2, sample_prompt="Hello", sample_tokens=8)
    with service.client() as c:
        job_id = c.post("/v1/jobs", json=spec).json()["id"]
    page.goto(service.url + "/")
    page.evaluate("t => sessionStorage.setItem('dmuon.token', t)", TOKEN)  # run alone too
    open_hash(page, service, f"#/job/{job_id}")
    expect(page.locator("#job-state")).to_contain_text("succeeded", timeout=JOB_TIMEOUT_MS)
    lines = (service.data_dir / "jobs" / job_id / "metrics.jsonl").read_text().splitlines()
    written = [json.loads(x) for x in lines if '"sample"' in x]
    assert [w["step"] for w in written] == [2, 4]
    figures = page.locator("#job-samples figure")
    expect(figures).to_have_count(2, timeout=30_000)
    shown = figures.evaluate_all(
        "fs => fs.map(f => [Number(f.dataset.step), f.querySelector('pre').textContent])"
    )
    # Newest first, each the prompt and what followed it, character for character.
    assert shown == [[w["step"], w["prompt"] + w["text"]] for w in reversed(written)]
    expect(page.locator("#job-events")).not_to_contain_text("Hello")  # not among the events
    # The step axis spans the steps drawn, with whole-number ticks (not 0-100 or 2.5).
    wait_drawn(page, 4)
    scale, ticks = page.evaluate(
        "() => { const u = document.querySelector('#chart-loss')._uplot;"
        " return [[u.scales.x.min, u.scales.x.max], u.axes[0]._splits]; }"
    )
    assert scale == [1, 4] and ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_pair_hint_goes_with_its_button(page: Page, service: Service) -> None:
    page.goto(service.url + "/")
    page.evaluate("t => sessionStorage.setItem('dmuon.token', t)", TOKEN)
    open_hash(page, service, "#/submit")
    expect(page.locator("#submit-pair")).to_be_visible()
    expect(page.locator("#pair-help")).to_be_visible()
    page.check("#kind-script")
    expect(page.locator("#submit-pair")).to_be_hidden()
    expect(page.locator("#pair-help")).to_be_hidden()
    page.check("#kind-train")
    expect(page.locator("#pair-help")).to_be_visible()


def test_restart_mid_stream_then_cancel(page: Page, service: Service) -> None:
    with service.client() as c:
        job_id = c.post("/v1/jobs", json=tiny_spec("long", steps=100_000)).json()["id"]
    stream_requests: list[Request] = []

    def on_request(request: Request) -> None:
        if request.url.split("?")[0].endswith(f"/v1/jobs/{job_id}/events"):
            stream_requests.append(request)

    page.on("request", on_request)
    open_hash(page, service, f"#/job/{job_id}")
    wait_drawn(page, 3, timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#stream-status")).to_have_attribute("data-status", "open")

    drawn_before = len(drawn_steps(page))
    service.restart()  # SIGKILL + start on the same port; the job keeps running
    shown = len(drawn_steps(page))
    expect(page.locator("#stream-status")).to_have_attribute("data-status", "open", timeout=60_000)
    wait_drawn(page, shown + 3, timeout=90_000)
    steps = drawn_steps(page)
    assert steps == list(range(1, len(steps) + 1)), "gap or duplicate after the reconnect"
    # The page reconnected, resuming after the last step it had received.
    resumed = [r for r in stream_requests if "last-event-id" in r.headers]
    assert resumed, [r.headers for r in stream_requests]
    assert drawn_before <= int(resumed[0].headers["last-event-id"]) <= shown
    assert resumed[0].all_headers()["authorization"] == f"Bearer {TOKEN}"
    page.remove_listener("request", on_request)

    # Cancel it from its page with the keyboard; Escape keeps the job, confirming cancels.
    page.focus("#cancel-job")
    page.keyboard.press("Enter")
    expect(page.locator("#confirm-dialog")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("#confirm-dialog")).to_be_hidden()
    assert service.job(job_id)["state"] == "running"
    page.focus("#cancel-job")
    page.keyboard.press("Enter")
    page.locator("#confirm-ok").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#job-state .state")).to_have_attribute(
        "data-state", "cancelled", timeout=60_000
    )
    expect(page.locator("#cancel-job")).to_be_hidden()
    wait_until(lambda: service.job(job_id)["state"] == "cancelled", 30, "the cancel")
    stored = service.steps(job_id)
    page.wait_for_function(
        "n => document.querySelector('#chart-loss')._uplot.data[0].length === n",
        arg=len(stored),
    )
    assert drawn_steps(page) == stored == list(range(1, len(stored) + 1))


def _shoot(page: Page, name: str) -> None:
    page.wait_for_timeout(200)  # a few animation frames for the charts
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_screenshots_and_no_request_leaves_the_origin(
    page: Page, service: Service, requests_made: list[str]
) -> None:
    with service.client() as c:
        jobs = c.get("/v1/jobs", params={"state": "succeeded"}).json()["items"]
    pair = [j["id"] for j in jobs if j["name"] and j["name"].startswith("pair ")]
    single = next(j["id"] for j in jobs if j["name"] == "form-tiny")
    routes = {
        "jobs": "#/jobs",
        "job": f"#/job/{single}",
        "compare": f"#/compare?ids={','.join(pair)}",
        "submit": "#/submit",
    }

    def show(name: str) -> None:
        """Open a page and wait until its data is on it."""
        open_hash(page, service, routes[name])
        if name == "jobs":
            expect(page.locator("#jobs-table tbody tr").first).to_be_attached()
        elif name == "job":
            expect(page.locator("#stream-status[data-status=ended]")).to_be_attached()
            wait_drawn(page, 61)
            expect(page.locator("#job-logs")).not_to_be_empty()
        elif name == "compare":
            wait_drawn(page, 12, "#chart-cmp-tokens")
        else:
            expect(page.locator("#dry-run-ok")).to_be_attached()

    # The state filter shows what the API lists for that state, newest first.
    show("jobs")
    page.select_option("#state-filter", "succeeded")
    page.wait_for_url("**/#/jobs?state=succeeded")
    rows = page.locator("#jobs-table tbody tr")
    expect(rows).to_have_count(len(jobs))
    assert [rows.nth(i).get_attribute("data-job-id") for i in range(len(jobs))] == [
        j["id"] for j in jobs
    ]

    page.evaluate("localStorage.setItem('dmuon.theme', 'light')")
    page.reload()
    # From the keyboard: the first Tab reaches the skip link, which moves to the content.
    expect(page.locator("#main h1")).to_be_visible()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"
    for theme in ("light", "dark"):
        if theme == "dark":
            page.click("#theme-switch")  # the page's own switch, remembered in local storage
        for width, suffix in ((1280, ""), (390, "-390")):
            page.set_viewport_size({"width": width, "height": 900})
            for name in routes:
                show(name)
                assert page.evaluate("document.documentElement.dataset.theme") == theme
                # Nothing is wider than a 390 px screen but the scrollable tables.
                if width == 390:
                    overflow = page.evaluate(
                        "document.documentElement.scrollWidth - window.innerWidth"
                    )
                    assert overflow <= 0, f"{name} is {overflow} px too wide at 390 px"
                _shoot(page, f"{name}-{theme}{suffix}")
    assert page.evaluate("localStorage.getItem('dmuon.theme')") == "dark"

    # The top of some pages for the documentation, in English and (after the switch) Chinese.
    for lang in ("en", "zh"):
        if lang == "zh":
            page.click("#lang-switch")
            expect(page.locator("a[data-nav=jobs]")).to_have_text("作业")
            assert page.evaluate("document.documentElement.lang") == "zh-CN"
        for name, theme, width in sorted(DOCS_SHOTS):
            page.set_viewport_size({"width": width, "height": 760})
            page.evaluate(f"localStorage.setItem('dmuon.theme', '{theme}')")
            page.reload()
            show(name)
            page.evaluate("window.scrollTo(0, 0)")
            page.wait_for_timeout(200)
            page.screenshot(path=str(ARTIFACTS / f"docs-{lang}-{name}-{theme}-{width}.png"))
    show("jobs")
    expect(page.locator("#jobs-table")).to_contain_text("已成功")  # the state, in Chinese
    page.click("#lang-switch")
    expect(page.locator("a[data-nav=jobs]")).to_have_text("Jobs")

    origin = service.url
    assert requests_made, "no request was recorded"
    foreign = [u for u in requests_made if not u.startswith(origin + "/")]
    assert foreign == [], f"requests outside {origin}: {foreign}"
