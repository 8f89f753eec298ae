"""The order test files are handed to pytest-xdist's workers: longest first.

``make test`` runs two workers that each take whole files (``--dist loadfile``) in the
order collected (``--no-loadscope-reorder``). A long file handed out last keeps one worker
busy while the other has nothing left to run, so the files go out longest first, their
times taken from ``file_seconds.json`` (a full run's, on a 2-core machine) and, for a
file not in it, estimated from its tests' kinds. The files that read the built site go
out once ``SITE_AFTER_SECONDS`` of work has: the one build they share starts in the
background as collection ends (``tests/docs/conftest.py``), and a worker that asked for
the site before it is built would wait for it.

Each run with ``--file-progress`` writes its own files' times to
``test-artifacts/file-seconds.json``; copy a full run's over ``tests/file_seconds.json``
when files were added or changed much. The order changes no test's outcome: every file
still runs whole on one worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("file_seconds.json")
#: Seconds per test of each kind (see ``tests/conftest.py``), fitted to a full run on a
#: 2-core machine: the estimate for a file the table does not have.
KIND_SECONDS = {
    "browser": 6.0,
    "live_server": 4.0,
    "subprocess": 1.0,
    "multi_process": 0.5,
    "site_build": 0.1,
    "pure": 0.1,
}
#: Seconds of work (both workers' together) handed out before the files that read the
#: built site: its build takes 22 s of CPU, a minute while both workers run other files.
SITE_AFTER_SECONDS = 300.0


def _seconds_table() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(TABLE.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _kind_of(item: pytest.Item) -> str:
    return next((m.name for m in item.iter_markers() if m.name in KIND_SECONDS), "pure")


def reads_the_site(item: pytest.Item) -> bool:
    """Whether ``item`` uses the built site (the ``site`` or ``build`` fixture of
    ``tests/docs/conftest.py``)."""
    return bool({"site", "build"} & set(getattr(item, "fixturenames", ())))


def longest_files_first(items: list[pytest.Item], root: Path) -> list[pytest.Item]:
    """``items`` with their files in the order above; each file's tests keep their order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path.relative_to(root).as_posix(), []).append(item)
    table = _seconds_table()

    def seconds(name: str) -> float:
        if name in table:
            return table[name]
        return sum(KIND_SECONDS[_kind_of(item)] for item in files[name])

    # sorted() is stable: files of equal time keep the collection's order, which every
    # worker shares, so all workers agree on the order (xdist checks that they do).
    by_time = sorted(files, key=seconds, reverse=True)
    waiting = [name for name in by_time if any(map(reads_the_site, files[name]))]
    site = set(waiting)
    ordered: list[str] = []
    handed_out = 0.0
    for name in by_time:
        if name in site:
            continue
        if waiting and handed_out >= SITE_AFTER_SECONDS:
            ordered += waiting
            waiting = []
        ordered.append(name)
        handed_out += seconds(name)
    ordered += waiting
    return [item for name in ordered for item in files[name]]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the files (after ``tests/conftest.py`` has marked each test's kind)."""
    ordered = longest_files_first(items, config.rootpath)
    assert sorted(map(id, ordered)) == sorted(map(id, items)), "file order: a test lost or twice"
    items[:] = ordered
