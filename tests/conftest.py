"""What every test run shares: in CI, a skip must have a declared environment reason; no
process a test started outlives pytest.

A test that skips for any other reason (a broken import, a missing tool that CI installs)
would let a broken suite pass, so under ``CI=true`` such a skip is reported as a failure.
The declared reasons are the hardware CI machines lack.

When pytest ends, however it ends (Ctrl-C, SIGTERM and ``timeout`` included), each pytest
process (the controller and every xdist worker) terminates what is left of the processes
it started, their own sessions included (rank processes, servers, torchrun jobs), and
kills those still alive 3 seconds later.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import sys
from collections.abc import Iterator

import pytest

#: One line per finished test file (``--file-progress``, which ``make test`` passes); the
#: files handed to pytest-xdist's workers longest first.
pytest_plugins = ["file_progress", "file_order"]
# Marked before this file imports one of them, as pytest does for the plugins it loads:
# otherwise every run warns that the module was imported before it could be rewritten.
pytest.register_assert_rewrite(*pytest_plugins)

from file_order import reads_the_site  # noqa: E402

#: Skips CI accepts: the machines it runs on have no GPU.
DECLARED_CI_SKIPS = re.compile(r"\bCUDA\b")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_undeclared_skip(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    """Under ``CI=true``, turn ``report``'s skip into a failure unless its reason is
    declared."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if DECLARED_CI_SKIPS.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{what} skipped in CI without a declared environment reason ({reason}); CI must "
        "run every test that does not need a GPU: install what it needs in .ci/run, or fix it"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test's skip (see the module docstring)."""
    outcome = yield
    _fail_undeclared_skip(outcome.get_result(), item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A whole module skipped at collection (``importorskip``)."""
    outcome = yield
    _fail_undeclared_skip(outcome.get_result(), collector.nodeid)


#: Test kinds, from what a test uses (markers set at collection; ``make test-fast`` runs
#: the ``pure`` ones): a browser, the built site, a live server process, several
#: processes of one distributed run, or other subprocesses.
KINDS = ("browser", "site_build", "live_server", "multi_process", "subprocess", "pure")


def _kind(item: pytest.Item) -> str:
    module = getattr(item, "module", None)
    names = set(vars(module)) if module is not None else set()
    # A test made in another module (the docs' per-page examples) uses what that one does.
    function = getattr(item, "function", None)
    defining = sys.modules.get(getattr(function, "__module__", ""))
    if defining is not None and defining is not module:
        names |= set(vars(defining))
    fixtures = set(getattr(item, "fixturenames", ()))
    path = str(item.path)
    if "browser" in path or "browser" in fixtures:
        return "browser"
    if reads_the_site(item):
        return "site_build"
    if "LiveServer" in names or fixtures & {"slurm_cluster", "live", "team"}:
        return "live_server"
    if names & {"spawn_ranks", "run_distributed", "run_torchrun", "torchrun"}:
        return "multi_process"
    if "subprocess" in names or fixtures & {"client", "spawned"}:
        return "subprocess"
    return "pure"


def _end_descendants(grace: float = 3.0) -> None:
    """Terminate this process's remaining descendants; kill those alive after ``grace``."""
    import psutil

    try:
        left = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in left:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(left, timeout=grace)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """No process a test started outlives pytest (see the module docstring)."""
    _end_descendants()


def pytest_configure(config: pytest.Config) -> None:
    """Register the kinds as markers; SIGTERM (``timeout``'s default) ends the run as
    Ctrl-C does, so the clean-up above runs in every pytest process."""
    signal.signal(signal.SIGTERM, _interrupt)
    for kind in KINDS:
        config.addinivalue_line("markers", f"{kind}: a test of kind {kind} (set automatically)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its kind."""
    for item in items:
        item.add_marker(getattr(pytest.mark, _kind(item)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep what collection made out of the garbage collector's reach for the session.

    Collection imported torch, transformers, the job service and every test module: a few
    million objects that live as long as the pytest process, and that each full collection
    during the tests would scan again. Frozen (after one collection of their leftovers),
    the collections made while tests run scan only what the tests create: a fifth less
    CPU time in the files that train in-process. Objects a test makes are collected as
    before.
    """
    gc.collect()
    gc.freeze()
