"""Shared fixtures of the documentation tests: one strict build of the whole site."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from docs_md import REPO
from file_order import reads_the_site
from filelock import FileLock


@dataclass(frozen=True)
class Build:
    """A finished ``mkdocs build --strict`` of the site."""

    site: Path
    returncode: int
    log: str


def docs_env() -> dict[str, str]:
    """Environment for subprocesses of the docs tests: CPU only, quiet, venv first on PATH."""
    env = dict(os.environ)
    env["NO_MKDOCS_2_WARNING"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    # The training recipe caches its tokenized corpus here instead of in ~/.cache/dmuon.
    env.setdefault("DMUON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "dmuon-docs-cache"))
    return env


#: How long a test waits for the site's build before failing.
BUILD_TIMEOUT_S = 300


def _build_root(config: pytest.Config) -> Path:
    """The folder all processes of this run share: pytest's base temporary folder (under
    pytest-xdist, the parent of each worker's). ``_tmp_path_factory`` is the object behind
    the ``tmp_path_factory`` fixture, which hooks cannot request."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the one build of the site the run's tests share, in the background, as soon
    as a collected test needs it: the workers run other tests meanwhile."""
    if session.config.option.collectonly:
        return
    if any(map(reads_the_site, session.items)):
        _start_build(_build_root(session.config))


def _start_build(root: Path) -> None:
    """Start ``mkdocs build --strict`` into ``root/site`` unless another process of this
    run has; its output goes to ``root/site-build.log``, its exit status to
    ``root/site-build.rc`` when it ends (written whole: renamed into place)."""
    with FileLock(root / "site-build.lock"):
        log, status = root / "site-build.log", root / "site-build.rc"
        if log.exists():
            return
        command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
        command += ["--site-dir", str(root / "site")]
        # Detached (the shell returns at once; init reaps the build): no test process is
        # left with a child of its own, which the job service's tests would see.
        detached = '("$@"; echo $? > "$0.tmp"; mv "$0.tmp" "$0") < /dev/null &'
        with log.open("w") as out:
            subprocess.run(
                ["sh", "-c", detached, str(status), *command],
                cwd=REPO,
                env=docs_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                check=True,
            )


@pytest.fixture(scope="session")
def build(request: pytest.FixtureRequest) -> Build:
    """The run's build of the site, once it has ended (started at collection)."""
    root = _build_root(request.config)
    _start_build(root)  # a no-op unless collection did not start it
    status = root / "site-build.rc"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"mkdocs build did not end within {BUILD_TIMEOUT_S} s")
        time.sleep(0.2)
    returncode = int(status.read_text())
    log = (root / "site-build.log").read_text()
    return Build(site=root / "site", returncode=returncode, log=log)


@pytest.fixture(scope="session")
def site(build: Build) -> Path:
    """The built site; tests that need it fail (not error) if the strict build failed."""
    if build.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + build.log[-6000:])
    return build.site


from accounts import NORMAL_ACCOUNT, normal_account  # noqa: E402,F401  (tests import them from here)


def account_env(folder: Path) -> dict[str, str]:
    """`docs_env` for a run as `NORMAL_ACCOUNT` in ``folder``: its own home, cache and
    temporary files."""
    env = docs_env()
    env["HOME"] = str(folder)
    env["DMUON_CACHE_DIR"] = str(folder / "cache")
    env["TMPDIR"] = str(folder)
    return env


def run_shell_script(
    script: Path, env: dict[str, str], timeout: float, account: tuple[int, int] | None = None
) -> tuple[int, str, str]:
    """Run ``script`` with ``bash -euo pipefail`` in its folder (as ``account``, given:
    the folder and script become its, the folder 0755); ``(exit status, stdout, stderr)``.
    A session of its own, killed whole afterwards: what the script started in the
    background (a server, its jobs' launchers) ends with it."""
    import contextlib
    import signal

    extra: dict[str, Any] = {}
    if account is not None:
        script.parent.chmod(0o755)
        for path in (script.parent, script):
            os.chown(path, *account)
        extra = {"user": account[0], "group": account[1], "extra_groups": []}
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", str(script)],
        cwd=script.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **extra,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err
