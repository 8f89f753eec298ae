"""A limit asked for that the machine cannot hold stops the server at start-up; with
``--allow-unenforced-limits`` it starts and ``GET /v1/server`` says which limits are off.
A users file reloaded on SIGHUP is held to the same rule: refused (the users before stay),
or, with the flag, loaded and reported.

Oracles: the exit status and message of a real ``dmuon-server`` process run as a normal
account (which cannot create cgroups or mount volumes) and as root; what the machine
offers, asked independently (`Cgroups.detect`, `UserVolumes.detect`); a real HTTP client.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from accounts import folder_of, normal_account
from server_helpers import LiveServer, wait_until

from dmuon_server.launching.cgroups import Cgroups
from dmuon_server.launching.volumes import UserVolumes

TOKEN = secrets.token_urlsafe(24)


BOB_TOKEN = secrets.token_urlsafe(24)


def _users_file(folder: Path, bob: dict[str, Any] | None = None, **limits: Any) -> Path:
    """Ada (an admin, with ``limits``) and, given his limits, Bob."""
    path = folder / "users.json"
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    entries = [{"name": "ada", "token_sha256": digest, "admin": True, "limits": limits}]
    if bob is not None:
        bob_digest = hashlib.sha256(BOB_TOKEN.encode()).hexdigest()
        entries.append({"name": "bob", "token_sha256": bob_digest, "limits": bob})
    path.write_text(json.dumps({"users": entries}))
    path.chmod(0o600)
    return path


@pytest.fixture
def account_folder() -> Iterator[tuple[tuple[int, int], Path]]:
    """A normal account and a folder of its own."""
    account = normal_account()
    if account is None:
        pytest.skip("running the server as a normal account needs root (and useradd)")
    with folder_of(account, "dmuon-limits-") as folder:
        yield account, folder


def _server_as(
    account: tuple[int, int], folder: Path, *flags: str, log: Path | None = None
) -> subprocess.Popen[str]:
    """``dmuon-server`` as ``account`` with its data in ``folder`` (its standard error
    into ``log`` where given)."""
    for path in folder.iterdir():
        os.chown(path, *account)
    cmd = [sys.executable, "-m", "dmuon_server.cli", "--port", "0", "--gpus", "none",
           "--data-dir", str(folder / "data"), "--sandbox", "none", *flags]  # fmt: skip
    env = {**os.environ, "HOME": str(folder)}
    stderr = log.open("w") if log is not None else subprocess.PIPE
    return subprocess.Popen(
        cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
        user=account[0], group=account[1], extra_groups=[],
    )  # fmt: skip


def _server_info(folder: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
    """``GET /v1/server`` of the server ``proc`` once it answers; stops it after."""
    info_path = folder / "data" / "server.json"
    try:
        wait_until(lambda: proc.poll() is not None or info_path.exists(), 30, "the server to start")
        assert proc.poll() is None, proc.communicate()[1]
        url = json.loads(info_path.read_text())["url"]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url + "/v1/server").status_code == 401
        return wait_until(lambda: _get(url + "/v1/server", auth), 30, "GET /v1/server to answer")
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def _get(url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    try:
        response = httpx.get(url, headers=headers, timeout=5)
    except httpx.HTTPError:
        return None
    assert response.status_code == 200, response.text
    return response.json()


def test_a_normal_account_asking_for_limits_is_refused_with_what_to_do(
    account_folder: tuple[tuple[int, int], Path],
) -> None:
    account, folder = account_folder
    assert Cgroups.detect()[0] is not None, "the tests' own account makes job cgroups"
    users = _users_file(folder, disk_gib=0.1)
    proc = _server_as(account, folder, "--users-file", str(users), "--max-job-memory", "1",
                      "--max-job-cpus", "1")  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "dmuon-server: error: limits were asked for that this machine cannot hold" in err
    assert "memory (asked by --max-job-memory)" in err
    assert "cpus (asked by --max-job-cpus)" in err
    assert "disk (asked by disk_gib in the users file (ada))" in err
    assert "the server does not run as root" in err  # the volumes' reason
    assert "Delegate=yes" in err and "--allow-unenforced-limits" in err
    assert "pids" not in err.split("To hold them")[0]  # a default, not asked for
    assert not (folder / "data" / "server.json").exists()


def test_with_the_flag_it_starts_and_says_which_limits_are_off(
    account_folder: tuple[tuple[int, int], Path],
) -> None:
    account, folder = account_folder
    users = _users_file(folder, disk_gib=0.1, memory_gib=0.5)
    proc = _server_as(account, folder, "--users-file", str(users), "--max-job-memory", "1",
                      "--allow-unenforced-limits")  # fmt: skip
    info = _server_info(folder, proc)
    assert info["allow_unenforced_limits"] is True
    assert info["launcher"] == "local" and info["sandbox"] == "none"
    by_name = {limit["name"]: limit for limit in info["limits"]}
    assert set(by_name) == {"memory", "pids", "disk"}  # no --max-job-cpus: no CPU limit
    assert info["unenforced"] == ["memory", "pids", "disk"]
    assert by_name["memory"]["asked_by"] == (
        "--max-job-memory and memory_gib in the users file (ada)"
    )
    assert by_name["pids"]["asked_by"] is None  # the default of 4096
    assert by_name["disk"]["why"] == "the server does not run as root"


def test_defaults_a_normal_account_cannot_hold_are_reported_not_refused(
    account_folder: tuple[tuple[int, int], Path],
) -> None:
    account, folder = account_folder
    users = _users_file(folder)
    info = _server_info(folder, _server_as(account, folder, "--users-file", str(users)))
    assert info["allow_unenforced_limits"] is False
    assert [(x["name"], x["asked_by"], x["held"]) for x in info["limits"]] == [
        ("memory", None, False),
        ("pids", None, False),
    ]


def _status(url: str, token: str) -> int:
    return httpx.get(url + "/v1/server", headers={"Authorization": f"Bearer {token}"}).status_code


def _reload(
    account: tuple[int, int], folder: Path, proc: subprocess.Popen[str], **bob: Any
) -> None:
    """Rewrite the users file with Bob's ``bob`` limits and send the server SIGHUP."""
    users = _users_file(folder, bob=bob)
    os.chown(users, *account)
    proc.send_signal(signal.SIGHUP)


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "allowed"])
def test_a_reload_asking_for_a_limit_not_held_is_refused_or_reported(
    account_folder: tuple[tuple[int, int], Path], allowed: bool
) -> None:
    """A normal account cannot mount disk volumes. Reloading a users file that gives Bob a
    ``disk_gib`` keeps the users before (Bob's token is refused, the log says why and
    what to do); with ``--allow-unenforced-limits`` Bob is let in and the disk limit is
    reported off. A later good file loads either way."""
    account, folder = account_folder
    users, log = _users_file(folder), folder / "server.err"
    flags = ("--allow-unenforced-limits",) if allowed else ()
    proc = _server_as(account, folder, "--users-file", str(users), *flags, log=log)
    info_path = folder / "data" / "server.json"
    try:
        wait_until(lambda: proc.poll() is not None or info_path.exists(), 30, "the server to start")
        assert proc.poll() is None, log.read_text()
        url = json.loads(info_path.read_text())["url"]
        wait_until(lambda: _get(url + "/healthz", {}) is not None, 30, "the server to answer")
        _reload(account, folder, proc, disk_gib=0.1)
        if allowed:
            wait_until(lambda: _status(url, BOB_TOKEN) == 200, 30, "Bob to be let in")
            info = _get(url + "/v1/server", {"Authorization": f"Bearer {TOKEN}"})
            assert info is not None and "disk" in info["unenforced"]
            disk = next(x for x in info["limits"] if x["name"] == "disk")
            assert disk["asked_by"] == "disk_gib in the users file (bob)" and not disk["held"]
        else:
            refused = "users not reloaded, the previous ones stay: limits were asked for"
            wait_until(lambda: refused in log.read_text(), 30, "the reload to be refused")
            text = log.read_text()
            assert "disk (asked by disk_gib in the users file (bob))" in text, text
            assert "--allow-unenforced-limits" in text
            assert _status(url, BOB_TOKEN) == 401 and _status(url, TOKEN) == 200
            info = _get(url + "/v1/server", {"Authorization": f"Bearer {TOKEN}"})
            assert info is not None and "disk" not in [x["name"] for x in info["limits"]]
        _reload(account, folder, proc)  # Bob without limits: loads either way
        wait_until(lambda: _status(url, BOB_TOKEN) == 200, 30, "Bob to be let in")
    finally:
        proc.terminate()
        proc.communicate(timeout=20)


def test_root_without_usr_sbin_on_path_holds_disk_quotas_or_refuses(tmp_path: Path) -> None:
    """As cron starts it: PATH without /usr/sbin. The quota tools are found there all the
    same; where this machine cannot mount volumes at all, the server refuses instead."""
    if os.geteuid() != 0:
        pytest.skip("disk quotas need a root server")
    users = _users_file(tmp_path, disk_gib=0.1)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    holds = UserVolumes.detect(tmp_path / "probe", tmp_path / "probe" / "jobs")[0] is not None
    server = LiveServer(tmp_path / "d", "--users-file", str(users), env=env)
    if not holds:
        with pytest.raises(AssertionError, match="disk \\(asked by disk_gib"):
            server.start()
        return
    server.start()
    try:
        with server.client(headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            info = c.get("/v1/server").json()
    finally:
        server.stop()
    assert {"name": "disk", "asked_by": "disk_gib in the users file (ada)", "held": True,
            "why": ""} in info["limits"]  # fmt: skip
    assert info["unenforced"] == []


def test_the_dashboard_shows_the_limits_that_are_off_in_chromium(
    account_folder: tuple[tuple[int, int], Path],
) -> None:
    """The banner names what ``GET /v1/server`` says is off, in English and Chinese."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        sync_playwright = None  # type: ignore[assignment]
    if chromium is None or sync_playwright is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the browser tests must run in CI: Chromium or Playwright is missing")
        pytest.skip("needs Chromium and Playwright's Python package")
    account, folder = account_folder
    users = _users_file(folder)
    proc = _server_as(account, folder, "--users-file", str(users), "--max-job-memory", "1",
                      "--allow-unenforced-limits")  # fmt: skip
    try:
        info_path = folder / "data" / "server.json"
        wait_until(lambda: info_path.exists(), 30, "the server to start")
        url = json.loads(info_path.read_text())["url"]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(f"{url}/#token={TOKEN}")
            banner = page.locator("#limits-banner")
            expect(banner).to_be_visible(timeout=30_000)
            expect(banner).to_contain_text("memory (--max-job-memory), pids.")
            page.click("#lang-switch")
            expect(banner).to_contain_text("本服务未执行的限制：memory (--max-job-memory), pids")
            browser.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
