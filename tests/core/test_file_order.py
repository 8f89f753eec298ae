"""The order ``make test`` hands its files to the workers (``tests/file_order.py``).

Oracles: the times written in the table (longest first), the kinds' estimate for a file
the table lacks, and the collection itself (every test once, each file's tests together
and in their order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import file_order
import pytest

ROOT = Path("/repo")


@dataclass
class FakeItem:
    """What the ordering reads of a test: its file, fixtures and kind marker."""

    path: Path
    name: str
    kind: str = "pure"
    fixturenames: list[str] = field(default_factory=list)

    def iter_markers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=self.kind)]


def _items(spec: dict[str, list[tuple[str, str, list[str]]]]) -> list[FakeItem]:
    return [
        FakeItem(ROOT / name, test, kind, fixtures)
        for name, tests in spec.items()
        for test, kind, fixtures in tests
    ]


def _files(items: list[FakeItem]) -> list[str]:
    out: list[str] = []
    for item in items:
        name = item.path.relative_to(ROOT).as_posix()
        if not out or out[-1] != name:
            out.append(name)
    return out


def test_files_go_out_longest_first_whole_and_in_their_own_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = {"tests/a.py": 5.0, "tests/b.py": 60.0, "tests/c.py": 20.0}
    monkeypatch.setattr(file_order, "_seconds_table", lambda: table)
    items = _items({
        "tests/a.py": [("a1", "pure", []), ("a2", "pure", [])],
        "tests/b.py": [("b1", "live_server", []), ("b2", "pure", []), ("b3", "pure", [])],
        "tests/c.py": [("c1", "subprocess", [])],
        # Not in the table: 3 live-server tests, estimated at 3 x 4 s.
        "tests/new.py": [("n1", "live_server", []), ("n2", "live_server", []),
                         ("n3", "live_server", [])],
    })  # fmt: skip
    ordered = file_order.longest_files_first(items, ROOT)  # type: ignore[arg-type]
    assert _files(ordered) == ["tests/b.py", "tests/c.py", "tests/new.py", "tests/a.py"]
    assert sorted(map(id, ordered)) == sorted(map(id, items))  # every test once
    assert [i.name for i in ordered if i.path.name == "b.py"] == ["b1", "b2", "b3"]


def test_files_that_read_the_site_go_out_once_enough_work_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    after = file_order.SITE_AFTER_SECONDS
    table = {"tests/long.py": after * 0.6, "tests/next.py": after * 0.5,
             "tests/site.py": after, "tests/short.py": 1.0}  # fmt: skip
    monkeypatch.setattr(file_order, "_seconds_table", lambda: table)
    items = _items({
        "tests/short.py": [("s", "pure", [])],
        "tests/site.py": [("x", "site_build", ["site"])],
        "tests/next.py": [("n", "multi_process", [])],
        "tests/long.py": [("l", "subprocess", [])],
        # Shorter than the files that go out before the site's: still once, with them.
        "tests/site_short.py": [("y", "site_build", ["build"]), ("z", "pure", [])],
    })  # fmt: skip
    ordered = file_order.longest_files_first(items, ROOT)  # type: ignore[arg-type]
    # The longest file is the site's, but it waits until 1.1 x SITE_AFTER_SECONDS of
    # work went out before it.
    assert _files(ordered) == [
        "tests/long.py", "tests/next.py", "tests/site.py", "tests/site_short.py", "tests/short.py"
    ]  # fmt: skip
    assert sorted(map(id, ordered)) == sorted(map(id, items))  # every test once
    # Too little work to wait for: the site's files go out last.
    table["tests/long.py"] = table["tests/next.py"] = 1.0
    last = _files(file_order.longest_files_first(items, ROOT))[-2:]  # type: ignore[arg-type]
    assert last == ["tests/site.py", "tests/site_short.py"]


def test_the_table_names_files_that_exist() -> None:
    """A renamed or deleted file left in the table is a stale entry: refresh the table."""
    repo = Path(file_order.__file__).resolve().parents[1]
    table = file_order._seconds_table()
    assert table, f"{file_order.TABLE} is missing or empty"
    missing = [name for name in table if not (repo / name).is_file()]
    assert not missing, (
        f"{missing} are in {file_order.TABLE} but not in the repository: copy a full run's "
        "test-artifacts/file-seconds.json over it"
    )
