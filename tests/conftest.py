"""What every test run shares: in CI, a skip must have a declared environment reason.

A test that skips for any other reason (a broken import, a missing tool that CI installs)
would let a broken suite pass, so under ``CI=true`` such a skip is reported as a failure.
The declared reasons are the hardware CI machines lack.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

#: Skips CI accepts: the machines it runs on have no GPU.
DECLARED_CI_SKIPS = re.compile(r"\bCUDA\b")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Under ``CI=true``, turn a skip without a declared reason into a failure."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if DECLARED_CI_SKIPS.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in CI without a declared environment reason ({reason}); CI must run "
        "every test that does not need a GPU: install what it needs in .ci/run, or fix it"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """The same for a whole module skipped at collection (``importorskip``)."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped:
        return
    reason = _skip_reason(report)
    if DECLARED_CI_SKIPS.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{collector.nodeid} skipped in CI without a declared environment reason ({reason}); "
        "install what it needs in .ci/run, or fix it"
    )
