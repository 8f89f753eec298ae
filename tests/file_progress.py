"""``--file-progress``: one line per finished test file, for a person watching a long run.

Each line gives the file's kind (core, server, docs, fuzz), how many of its tests passed,
failed and were skipped, the file's own time (the sum of its tests'), how many files are
done and the time since the run began. Passing tests print nothing else (no dots); a
failure still prints its ``F`` at once and its report at the end, and ``--durations``
lists the slowest tests. Works with and without pytest-xdist (the controller counts each
file's tests from the workers' collection).
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from typing import Any

import pytest


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _kind(path: str) -> str:
    parts = path.split("/")
    if "fuzz" in path:
        return "fuzz"
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


class FileProgress:
    """The plugin: counts each file's reports and prints a line when the last one is in."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.expected: Counter[str] = Counter()
        self.outcomes: dict[str, Counter[str]] = defaultdict(Counter)
        self.seconds: Counter[str] = Counter()
        self.start = time.monotonic()
        self.done: set[str] = set()
        self.letters_on_the_line = False

    def _expect(self, nodeids: list[str]) -> None:
        if self.expected:
            return  # every worker collects the same tests; count them once
        for nodeid in nodeids:
            self.expected[_file(nodeid)] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if not hasattr(self.config, "workerinput"):
            self._expect([item.nodeid for item in items])

    @pytest.hookimpl(optionalhook=True)  # known only where pytest-xdist is loaded
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self._expect(list(ids))

    def pytest_report_teststatus(self, report: pytest.TestReport) -> tuple[str, str, str] | None:
        if report.passed and report.when == "call":
            return "passed", "", "PASSED"
        if report.failed or report.skipped:
            self.letters_on_the_line = True  # the reporter writes its F or s
        return None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = _file(report.nodeid)
        self.seconds[path] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "failed" if report.failed else report.outcome
            self.outcomes[path][outcome] += 1
        elif report.when == "teardown" and report.failed:
            self.outcomes[path]["error"] += 1
        if report.when != "teardown":
            return
        counts = self.outcomes[path]
        finished = counts["passed"] + counts["failed"] + counts["skipped"]
        if path in self.done or finished < self.expected.get(path, 0):
            return
        self.done.add(path)
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        elapsed = time.monotonic() - self.start
        line = (
            f"[{_kind(path):>6}] {path}: {summary} in {self.seconds[path]:.1f} s "
            f"({len(self.done)}/{len(self.expected)} files, "
            f"{int(elapsed // 60)}:{int(elapsed % 60):02d} elapsed)"
        )
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            if self.letters_on_the_line:
                reporter.write("\n")
                self.letters_on_the_line = False
            reporter.write_line(line, red=bool(counts["failed"] or counts["error"]))

    def pytest_sessionfinish(self) -> None:
        """Keep each finished file's time in ``test-artifacts/file-seconds.json``, the
        table ``file_order`` hands the files out by (``tests/file_seconds.json``).

        The times are added to what the file holds, so the two sessions of ``make test``
        (which empties it first) leave every file of the suite there."""
        times = {path: round(self.seconds[path], 1) for path in self.done}
        if not times:
            return
        out = self.config.rootpath / "test-artifacts" / "file-seconds.json"
        out.parent.mkdir(exist_ok=True)
        try:
            kept = json.loads(out.read_text())
        except (OSError, ValueError):
            kept = {}
        merged = {**(kept if isinstance(kept, dict) else {}), **times}
        out.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-progress",
        action="store_true",
        help="print one line per finished test file (its kind, counts and time) instead of dots",
    )


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--file-progress") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(FileProgress(config), "file-progress")
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            # Without pytest-xdist the reporter would start a line with each file's name
            # that nothing else is written on.
            reporter.showfspath = False
